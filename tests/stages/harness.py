"""Drive stage replicas in one process through their production path: the
frame handlers a served replica runs (`StageLoop.handle`), with an
in-process channel in place of the socket. Commands go in as the channel's
reader thread would hand them over; events come back sorted per request,
as the frontend's `ChannelServer` sorts them."""
from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict

from engine.serving.frames import Attach, Deltas, FirstToken, Prefill, PrefillDone, Reserve, TicketReady
from engine.serving.types import GenerateDelta


class InProcessChannel:
    """What a stage sends lands in its request's inbox (each delta of a
    `Deltas` frame on its own)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._inboxes: dict[str, queue.Queue] = defaultdict(queue.Queue)

    def send(self, frame) -> bool:
        for event in frame.deltas if isinstance(frame, Deltas) else (frame,):
            self.inbox(event.request_id).put(event)
        return True

    def inbox(self, request_id: str) -> queue.Queue:
        with self._lock:
            return self._inboxes[request_id]


class Driver:
    """One stage replica with one in-process channel to it."""

    def __init__(self, stage):
        self.stage = stage
        self.channel = InProcessChannel()

    def send(self, frame) -> None:
        self.stage.handle(self.channel, frame)

    def next(self, request_id: str, timeout_s: float = 30.0):
        return self.channel.inbox(request_id).get(timeout=timeout_s)

    def until(self, request_id: str, kind: type, timeout_s: float = 30.0):
        """Events up to the first of type ``kind``: (that event, the ones before it)."""
        before = []
        deadline = time.monotonic() + timeout_s
        while True:
            event = self.next(request_id, max(0.01, deadline - time.monotonic()))
            if isinstance(event, kind):
                return event, before
            before.append(event)

    def stream(self, request_id: str, timeout_s: float = 30.0) -> list[GenerateDelta]:
        """The request's deltas up to its last."""
        deltas = []
        while not (deltas and deltas[-1].is_finished):
            event = self.next(request_id, timeout_s)
            assert isinstance(event, GenerateDelta), event
            deltas.append(event)
        return deltas


def disaggregated(prefill: Driver, decode: Driver, request_id: str, prompt: list[int], params,
                  ticket_first: bool = True, output_token_ids: list[int] = ()):
    """A request as the frontend runs it (resumed after ``output_token_ids``):
    returns (first token event, the decode replica's deltas, the prefill
    replica's PrefillDone)."""
    out = list(output_token_ids)
    if ticket_first:
        decode.send(Reserve(request_id, prompt, params, out))
        ticket = decode.next(request_id)
        assert isinstance(ticket, TicketReady), ticket
        prefill.send(Prefill(request_id, prompt, params, out))
        prefill.send(Attach(request_id, ticket.ticket))
        first = prefill.next(request_id)
    else:  # the prompt is computed before the ticket exists
        prefill.send(Prefill(request_id, prompt, params, out))
        first = prefill.next(request_id)
        decode.send(Reserve(request_id, prompt, params, out))
        ticket = decode.next(request_id)
        assert isinstance(ticket, TicketReady), ticket
        prefill.send(Attach(request_id, ticket.ticket))
    assert isinstance(first, FirstToken), first
    done = prefill.next(request_id)
    assert isinstance(done, PrefillDone), done
    return first, decode.stream(request_id) if done.ok else [], done


def wait_free(*stages, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(s.is_fully_free() for s in stages):
            return True
        time.sleep(0.05)
    return False
