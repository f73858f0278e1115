"""The prefill side of a transfer: push a request's KV into the blocks of its ticket.

1. ``start(ticket, ...)``    queue the transfer; the worker thread opens (or
                             reuses) an authenticated link to the ticket's endpoint.
2. ``push_layer(rid, l)``    from the engine's per-layer hook: queue layer l's
                             chunks (planned by planner.plan_layer).
3. ``commit(rid, token)``    sent as soon as every layer was sent; the receiver
                             marks the transfer DONE when the last chunk has landed,
                             the sender when the commit and every chunk were acknowledged.
4. ``poll()``                returns finished sends: DONE, or FAILED on a refused
                             handshake, a lost receiver, an abort or the deadline.

All public methods return at once; the one worker thread and the transports'
threads do the moving. The source blocks must stay allocated until poll()
reported the transfer (the prefill stage frees them then).

Tensor parallelism: one sender per prefill replica, in rank 0's process,
reading every rank's cache (``kv_caches`` rank -> layer, with the replica's
KVLayout). When a link opens, the sender checks the reshard plan from its
layout into the receiver's (from the handshake reply; the receiver has
checked it too) and then sends, per layer, each unit of the plan: a global
KV-head range read from one rank (whole slabs when it is all of that rank's
heads, else a strided copy). A transfer is DONE only when the receiver
acknowledged every chunk and the commit; the receiver is one per decode
replica and acknowledges for all of its ranks, so DONE (and freeing the
source blocks on every prefill rank) means every decode rank has its heads.

Pipeline parallelism: the replica's ranks are pp_size x tp_size, rank r's
cache a LOCAL list of the global layers ``layout.layers_of(r)``. The sender
indexes every rank's cache by global layer id (``KVLayout.global_layers``),
so a chunk, which names a global layer, reads the buffer of that layer on
the rank that holds it; nothing pairs by list position. ``push_layer`` takes
global layer ids, whichever pipeline rank wrote them: each rank's layers
leave as their hooks fire, not at the end of the forward pass.

One ``config.SenderConfig`` sets the deadline, timeouts, chunk size and
checksum, and each transport's link options; every link gets it whole from
``transports.connect`` and reads its own part.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field, replace

import torch

from kvtransfer import auth, transports
from kvtransfer.config import SenderConfig
from kvtransfer.layout import KVLayout, normalize_caches, with_layout
from kvtransfer.planner import ChunkPlan, blocks_for_tokens, coalesce_layers, merge_heads, plan_layer
from kvtransfer.reshard import TransferPlan
from kvtransfer.slabs import rank_views
from kvtransfer.types import Ack, HandshakeError, PlanError, State, Ticket, TransferError, TransferResult


@dataclass(eq=False)
class Outbound:
    ticket: Ticket
    # rank -> GLOBAL layer id -> [num_blocks, rows, heads, head_bytes] uint8 (None: a layer the rank does not hold)
    src_bytes: list[list[torch.Tensor | None]]
    src_block_ids: list[int]
    deadline: float
    num_layers: int
    plans: list[list[ChunkPlan]] = field(default_factory=list)  # per layer, once the link (and its plan) is known
    state: State = State.RESERVED
    link: object | None = None
    num_chunks_acked: int = 0
    first_token: int | None = None
    is_commit_sent: bool = False
    is_commit_acked: bool = False
    error: str | None = None
    is_reported: bool = False
    finished_at: float | None = None
    layers_pushed: set[int] = field(default_factory=set)
    layers_held: set[int] = field(default_factory=set)  # TP: hooked, not yet known written on every rank
    layer_ready: dict[int, object] = field(default_factory=dict)  # CUDA: layer -> event recorded by the hook

    @property
    def num_chunks(self) -> int:
        return sum(len(p) for p in self.plans)


class KVSender:
    """Prefill-side endpoint, configured by one SenderConfig (deadline, timeouts, chunk size, checksum,
    and each transport's link options), which its links get whole."""

    def __init__(self, fingerprint: dict[str, str], config: SenderConfig, layout: KVLayout | None = None):
        """layout: which KV heads each rank of this replica holds; None: the one-rank layout the fingerprint
        describes. ``fingerprint`` gets the layout's fields (tp_size, per-rank heads)."""
        auth.as_secret(config.secret)  # no secret, no sender
        if layout is None:
            try:
                layout = KVLayout.from_fingerprint(fingerprint)
            except ValueError:
                layout = None  # no layout: start() and a link's plan refuse
        self.layout = layout
        self.fingerprint = with_layout(fingerprint, layout) if layout is not None else dict(fingerprint)
        self.config = config
        self._lock = threading.Lock()
        self._sends: dict[str, Outbound] = {}
        self._links: dict[str, object] = {}
        self._events: queue.Queue = queue.Queue()
        self._is_closed = False
        self._worker = threading.Thread(target=self._run, name="kvt-sender", daemon=True)
        self._worker.start()

    # ---- public API (any thread, never blocks) ---------------------------
    def connect(self, endpoint: str) -> None:
        """Handshake with ``endpoint`` now (blocking); raises HandshakeError or TransferError."""
        self._link_for(endpoint)

    def start(self, ticket: Ticket, kv_caches, src_block_ids: list[int], num_tokens: int) -> None:
        """Queue one request's KV: ``src_block_ids`` (the same ids on every rank) of ``kv_caches``, rank -> local
        layer -> tensor (at TP=1 also layer -> tensor; under pipeline parallelism rank r's list holds the layers
        ``layout.layers_of(r)``, read by global layer id), into the ticket's blocks."""
        if self.layout is None:
            raise ValueError("KVSender: the fingerprint names no KV layout (num_layers, num_kv_heads, head_dim, "
                             "block_size, dtype): pass layout=")
        ranks = normalize_caches(kv_caches)
        self.layout.check_caches(ranks)
        num_blocks = blocks_for_tokens(num_tokens, self.layout.block_size)
        if num_blocks != len(ticket.block_ids) or num_blocks != len(src_block_ids):
            raise ValueError(f"{num_tokens} tokens need {num_blocks} blocks; ticket has {len(ticket.block_ids)},"
                             f" source has {len(src_block_ids)}")
        ob = Outbound(ticket, self.layout.global_layers(rank_views(ranks)), list(src_block_ids), time.time() + self.config.deadline_s,
                      self.layout.num_layers)
        with self._lock:
            if ticket.request_id in self._sends:
                raise ValueError(f"request {ticket.request_id!r} is already being sent")
            self._sends[ticket.request_id] = ob
        self._events.put(("start", ob))

    def push_layer(self, request_id: str, layer: int) -> None:
        """Queue layer ``layer`` (rank 0's KV of it is written). A no-op once the transfer was reported by poll().

        In a TP group rank 0's hook runs after its attention of ``layer`` and before that layer's all-reduces,
        so another rank has surely written its KV of a layer only once rank 0 is past them: a layer is sent
        once the hook of a later layer ran, the last one at ``commit`` (after the forward pass).

        Pipeline parallelism: ``layer`` is a global layer id, whichever pipeline rank holds it; the hook of a
        stage's first layer runs after the stage before it finished, so the rule above holds across stages, and
        at TP=1 each layer leaves at its own hook, on its own pipeline rank's schedule.
        """
        ob = self._get(request_id)
        if ob is not None:
            for ready in self._ready_layers(ob, layer):
                self._queue_layer(ob, ready)

    def _ready_layers(self, ob: Outbound, layer: int) -> list[int]:
        if self.layout.tp_size == 1:
            return [layer]
        with self._lock:
            ob.layers_held.add(layer)
            top = max(ob.layers_held)
            ready = sorted(held for held in ob.layers_held if held < top)
            ob.layers_held.difference_update(ready)
        return ready

    def _queue_layer(self, ob: Outbound, layer: int) -> None:
        if next(kv for kv in ob.src_bytes[0] if kv is not None).is_cuda:  # the layer's kernels may still run: order the send after them
            ob.layer_ready[layer] = torch.cuda.Event()
            ob.layer_ready[layer].record()
        self._events.put(("layer", ob, layer))

    def hook(self, *request_ids: str):
        """The engine's per-layer hook ``Callable[[int], None]`` for the requests of one batch."""
        def push(layer: int) -> None:
            for request_id in request_ids:
                self.push_layer(request_id, layer)

        return push

    def commit(self, request_id: str, first_token: int) -> None:
        """Queue the first token (sampled: the forward pass ended), and the layers held back for it; sent once
        every layer was. A no-op once the transfer was reported."""
        ob = self._get(request_id)
        if ob is not None:
            with self._lock:
                held, ob.layers_held = sorted(ob.layers_held), set()
            for layer in held:
                self._queue_layer(ob, layer)
            self._events.put(("commit", ob, int(first_token)))

    def renew(self, ticket: Ticket, lease_s: float) -> None:
        """Extend the receiver's lease while the request waits in the prefill queue (best effort)."""
        self._events.put(("renew", ticket, lease_s))

    def abort(self, request_id: str) -> None:
        with self._lock:
            ob = self._sends.get(request_id)
        if ob is not None:
            self._fail(ob, "aborted by sender")

    def poll(self) -> list[TransferResult]:
        results = []
        now = time.time()
        with self._lock:
            sends = list(self._sends.values())
        for ob in sends:
            if not ob.state.is_finished and now > ob.deadline:
                self._fail(ob, f"deadline of {self.config.deadline_s}s exceeded")
            with self._lock:
                if ob.state.is_finished and not ob.is_reported:
                    ob.is_reported = True
                    results.append(TransferResult(ob.ticket.request_id, ob.state.name, ob.first_token
                                                  if ob.state == State.DONE else None, ob.error,
                                                  list(ob.src_block_ids), ob.finished_at))
                    del self._sends[ob.ticket.request_id]
        return results

    def close(self) -> None:
        with self._lock:
            sends = list(self._sends.values())
        for ob in sends:
            self._fail(ob, "sender closed")
        self._is_closed = True
        self._events.put(None)
        self._worker.join(timeout=5)
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()

    # ---- worker ----------------------------------------------------------
    def _run(self) -> None:
        """Handle events in order; layer pushes that queued up meanwhile are sent together."""
        while True:
            batch = [self._events.get()]
            while True:
                try:
                    batch.append(self._events.get_nowait())
                except queue.Empty:
                    break
            pending: dict[Outbound, list[int]] = {}
            for event in batch:
                if event is not None and event[0] == "layer":
                    pending.setdefault(event[1], []).append(event[2])
                    continue
                self._send_pending(pending)
                pending = {}
                if event is None:
                    return
                self._guarded(event[1], self._handle, *event)
            self._send_pending(pending)

    def _guarded(self, ob, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # never let the worker die; fail the transfer instead
            if isinstance(ob, Outbound):
                if ob.link is not None:  # its transport raised: the next transfer gets a new link
                    ob.link.is_broken = True
                self._fail(ob, f"sender error: {type(e).__name__}: {e}")

    def _send_pending(self, pending: dict[Outbound, list[int]]) -> None:
        for ob, layers in pending.items():
            self._guarded(ob, self._send_layers, ob, layers)

    def _handle(self, kind: str, ob, arg=None) -> None:
        if kind == "renew":
            self._link_for(ob.endpoint).renew(ob.transfer_id, arg)
            return
        if kind == "abort_remote":  # so the receiver frees its blocks now, not at the lease
            (ob.link or self._link_for(ob.ticket.endpoint)).abort(ob.ticket.transfer_id, arg)
            return
        if ob.state.is_finished:
            return
        if kind == "start":
            try:
                link = self._link_for(ob.ticket.endpoint)
            except (HandshakeError, TransferError) as e:
                self._fail(ob, str(e), notify=False)
                return
            ob.plans = self._chunk_plans(link.kv_plan, len(ob.ticket.block_ids))
            ob.link = link
        elif kind == "commit":
            ob.first_token = arg
            self._maybe_commit(ob)

    def _send_layers(self, ob: Outbound, layers: list[int]) -> None:
        layers = [layer for layer in dict.fromkeys(layers) if layer not in ob.layers_pushed]
        with self._lock:
            if ob.link is None or ob.state.is_finished or not layers:
                return
            ob.layers_pushed.update(layers)
            ob.state = State.TRANSFERRING
        for layer in layers:
            if layer in ob.layer_ready:
                ob.layer_ready.pop(layer).synchronize()
        # a unit's chunks of consecutive layers together, so that coalescing can merge them
        chunks = sorted((c for layer in layers for c in ob.plans[layer]), key=lambda c: (c.source, c.layer))
        chunks = coalesce_layers(chunks, self._unit_bytes, self.config.max_chunk_bytes)
        for chunk in chunks:
            if ob.state.is_finished:
                return
            future = ob.link.send_chunk(ob.ticket.transfer_id, chunk, ob.src_bytes, ob.src_block_ids,
                                        self.config.checksum)
            future.add_done_callback(lambda f, ob=ob, n=chunk.num_layers: self._on_chunk(ob, f, n))
        self._maybe_commit(ob)

    def _on_chunk(self, ob: Outbound, future, num_layers: int) -> None:
        ack = _ack_of(future)
        if not ack.ok:
            self._fail(ob, f"chunk refused: {ack.error}")
            return
        with self._lock:
            ob.num_chunks_acked += num_layers  # a coalesced chunk stands for one planned chunk per layer
        self._maybe_done(ob)

    def _unit_bytes(self, chunk: ChunkPlan) -> int:
        """A chunk's bytes per block: its heads' share of a block."""
        return (chunk.num_heads or self.layout.num_kv_heads) * self.layout.head_bytes

    def _chunk_plans(self, plan: TransferPlan, num_blocks: int) -> list[list[ChunkPlan]]:
        """Per layer, the chunks of each unit of the plan that covers it, each at most max_chunk_bytes."""
        plans: list[list[ChunkPlan]] = [[] for _ in range(self.layout.num_layers)]
        cap = self.config.max_chunk_bytes
        for u in plan.units:
            per_block = len(u.heads) * self.layout.head_bytes
            for layer in u.layers:
                plans[layer] += [replace(c, head_start=u.heads.start, num_heads=len(u.heads), src_rank=u.src.rank,
                                         src_head=u.src.head) for c in plan_layer(layer, num_blocks, per_block, cap)]
        # units that are adjacent head ranges of one source rank's slabs travel as one chunk (no strided copy)
        return [merge_heads(sorted(p, key=lambda c: (c.src_rank, c.first_block, c.src_head)), self._unit_bytes, cap)
                for p in plans]

    def _maybe_commit(self, ob: Outbound) -> None:
        """Commit once every layer was *sent* (not acknowledged): the receiver finishes on the last chunk."""
        with self._lock:
            if (ob.state.is_finished or ob.is_commit_sent or ob.first_token is None
                    or len(ob.layers_pushed) < ob.num_layers):
                return
            ob.is_commit_sent = True
        future = ob.link.commit(ob.ticket.transfer_id, ob.first_token)
        future.add_done_callback(lambda f: self._on_commit(ob, f))

    def _on_commit(self, ob: Outbound, future) -> None:
        ack = _ack_of(future)
        if not ack.ok:
            self._fail(ob, f"commit refused: {ack.error}")
            return
        with self._lock:
            ob.is_commit_acked = True
        self._maybe_done(ob)

    def _maybe_done(self, ob: Outbound) -> None:
        with self._lock:
            if not ob.state.is_finished and ob.is_commit_acked and ob.num_chunks_acked >= ob.num_chunks:
                ob.state, ob.finished_at = State.DONE, time.time()

    def _fail(self, ob: Outbound, error: str, notify: bool = True) -> None:
        with self._lock:
            if ob.state.is_finished:
                return
            ob.state, ob.finished_at = State.FAILED, time.time()
            ob.error = error
        if notify and not self._is_closed:
            self._events.put(("abort_remote", ob, error))

    def _link_for(self, endpoint: str):
        with self._lock:
            link = self._links.get(endpoint)
        if link is not None and not link.is_broken:
            return link
        if link is not None:
            link.close()  # its transport failed: free what it still holds (threads, sockets)
        link = transports.connect(endpoint, self.fingerprint, self.config)
        try:
            link.kv_plan = self._plan_for(link)
        except HandshakeError:
            link.close()
            raise
        with self._lock:
            self._links[endpoint] = link
        return link

    def _plan_for(self, link) -> TransferPlan:
        """The plan from this replica's layout into the receiver's (its fingerprint, from the handshake),
        checked here too: HandshakeError (PlanError naming the piece) before any byte moves."""
        if self.layout is None:
            raise HandshakeError("handshake refused: this sender's fingerprint names no KV layout")
        try:
            theirs = KVLayout.from_fingerprint(link.peer_fingerprint or {})
        except ValueError as e:
            raise HandshakeError(f"handshake refused: the receiver's {e}") from None
        try:
            return self.layout.plan_to(theirs)
        except PlanError as e:
            raise PlanError(f"plan refused: KV layout of {self.layout.shape_name} into {theirs.shape_name}: "
                            f"{e}") from None

    def _get(self, request_id: str) -> Outbound | None:
        with self._lock:
            return self._sends.get(request_id)


def _ack_of(future) -> Ack:
    try:
        return future.result()
    except Exception as e:
        return Ack(False, error=f"{type(e).__name__}: {e}")
