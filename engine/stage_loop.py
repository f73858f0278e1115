"""The machinery every serving stage shares: a loop thread that owns an
EngineCore, a command queue for calls from other threads, and per-request
output queues for streaming.

The stages (prefill, decode, colocated) are plain classes built on this; Ray
hosts them as threaded actors from the launcher, so calls arrive on Ray's
threads while the engine is only ever touched by the loop thread.

Requests reach a served replica over its request channel to the frontend
(`engine.channel`): commands come in on the channel's reader thread and run
on the loop thread; a request that came that way has its outputs sent back
on the same channel (one frame per step), not to a stream queue. The Python
API below (submit, reserve, prefill, stream) is the same machinery without
the channel, for tests and in-process use.
"""
from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.output import OutputProcessor, RequestOutput
from engine.profiling import ProfileWindow, enable_nvtx
from engine.channel import ChannelClient

log = logging.getLogger(__name__)


@dataclass
class Delta:
    """One chunk of a request's stream as it crosses process boundaries."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    logprobs: list[dict] | None = None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)

    @classmethod
    def from_output(cls, out: RequestOutput) -> "Delta":
        return cls(out.request_id, out.delta_token_ids, out.delta_text,
                   out.finish_reason if out.finished else None, out.error, out.delta_logprobs,
                   out.num_cached_tokens, out.metrics if out.finished else {})

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


_END = object()


def normal_priority() -> None:
    """Every thread of this process back to niceness 0, where allowed.

    Ray starts its worker processes at niceness 15 (its ``worker_niceness``),
    below every driver and system process. A replica is the workload: at 15,
    whatever else wakes on its host (the frontend forwarding a token, a
    client, Ray's own daemons) takes its core, and in measurements on a
    2-CPU host each decode step came out 2-3 ms slower. Threads created
    later inherit the value of the thread that creates them, so this runs
    again after a stage starts threads from Ray's.
    """
    if not hasattr(os, "setpriority"):
        return
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [threading.get_native_id()]
    refused = 0
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) > 0:
                os.setpriority(os.PRIO_PROCESS, tid, 0)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
        except OSError:
            refused += 1
    if refused:
        log.warning("this replica runs at niceness %d and may not lower it (set RAY_worker_niceness=0 on the "
                    "Ray cluster, or allow CAP_SYS_NICE): it yields its CPU to anything else on the host",
                    os.getpriority(os.PRIO_PROCESS, 0))


def load_engine(model_dir: str | Path, config: EngineConfig, num_threads: int | None = None):
    """EngineCore + tokenizer for a checkpoint folder (already converted)."""
    from engine.tokenizer import Tokenizer, TokenizerError
    from engine.weights import load_checkpoint

    if num_threads:
        torch.set_num_threads(num_threads)
    model_config, weights = load_checkpoint(Path(model_dir), torch.float32)
    core = EngineCore(model_config, weights, config)
    try:
        tokenizer = Tokenizer.from_folder(model_dir)
        core.eos_token_ids |= frozenset(tokenizer.eos_token_ids)
    except TokenizerError:
        tokenizer = None
    return core, tokenizer


class StageLoop:
    """Owns the engine on one thread. Subclasses implement ``_iterate``."""

    idle_wait_s = 0.05  # how long the loop sleeps on the command queue when there is no work
    busy_wait_s = 0.0005  # ... when transfers are in flight but nothing is runnable

    def __init__(self, replica_id: str, core: EngineCore, tokenizer):
        self.replica_id = replica_id
        self.core = core
        self.tokenizer = tokenizer
        self.outputs = OutputProcessor(tokenizer)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, queue.SimpleQueue] = {}
        self._streams_lock = threading.Lock()
        self._channels: list[ChannelClient] = []
        self._routes: dict[str, ChannelClient] = {}  # request id -> the channel it came by (loop thread)
        self._stopped = threading.Event()
        self._fatal: str | None = None
        self._load: dict = self._snapshot_load()
        self._profile: ProfileWindow | None = None
        self._is_cuda = str(core.config.device).startswith("cuda")
        if self._is_cuda:
            enable_nvtx()
        self._thread = threading.Thread(target=self._run, name=f"{replica_id}-loop", daemon=True)
        normal_priority()  # before the loop thread, which inherits it (and so do its OpenMP workers)
        self._thread.start()

    # ---- calls from other threads -----------------------------------------
    def call(self, fn: Callable, *args, timeout: float | None = 60.0):
        """Run ``fn(*args)`` on the loop thread and return its result."""
        if self._fatal:
            raise RuntimeError(f"{self.replica_id}: stage loop died: {self._fatal}")
        fut: Future = Future()
        self._commands.put((fn, args, fut))
        return fut.result(timeout=timeout)

    def post(self, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` on the loop thread, without waiting."""
        self._commands.put((fn, args, None))

    def open_stream(self, request_id: str) -> None:
        with self._streams_lock:
            if request_id in self._streams:
                raise ValueError(f"request_id: {request_id!r} is already running on {self.replica_id}")
            self._streams[request_id] = queue.SimpleQueue()

    def stream(self, request_id: str, timeout_s: float = 600.0) -> Iterator[list[Delta]]:
        """Yield batches of deltas for a request until it finishes."""
        with self._streams_lock:
            q = self._streams.get(request_id)
        if q is None:
            raise KeyError(f"request {request_id!r} is not on {self.replica_id}")
        try:
            while True:
                try:
                    item = q.get(timeout=timeout_s)
                except queue.Empty:
                    self.post(self._abort, request_id)
                    yield [Delta(request_id, [], "", "error", f"no output for {timeout_s}s")]
                    return
                batch = [item]
                while True:
                    try:
                        batch.append(q.get_nowait())
                    except queue.Empty:
                        break
                deltas = [d for d in batch if d is not _END]
                if deltas:
                    yield deltas
                if any(d is _END or d.finished for d in batch):
                    return
        finally:
            with self._streams_lock:
                self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self.post(self._abort, request_id)

    def fail(self, request_id: str, error: str) -> None:
        """End a request with an error (e.g. its prefill failed elsewhere)."""
        self.post(self._fail, request_id, error)

    def connect_channel(self, address: str, secret: bytes) -> None:
        """Dial the frontend's request channel at ``address`` (`engine.channel`);
        both ends prove they hold ``secret``. Raises if it cannot."""
        self._channels.append(ChannelClient(address, secret, self.replica_id, self._on_channel_command,
                                            self._on_channel_lost))
        normal_priority()  # the channel's reader thread, started from one of Ray's

    def start_profile(self, out_dir: str, with_stack: bool = False) -> None:
        """Open a profiler window on the loop thread (CPU, plus CUDA on a GPU).
        Raises if one is already open on this replica."""
        self.call(self._start_profile, out_dir, with_stack)

    def stop_profile(self) -> str:
        """Close the window; returns the Chrome trace's path on this host,
        ``<out_dir>/<replica_id>-<timestamp>.json``."""
        return self.call(self._stop_profile, timeout=300.0)

    def host(self) -> str:
        """This replica's host name (where its trace files are written)."""
        return socket.gethostname()

    def stop(self) -> None:
        self._stopped.set()
        self._commands.put((lambda: None, (), None))
        self._thread.join(timeout=10)

    # ---- loop thread ---------------------------------------------------------
    def _channel_for(self, delta: Delta) -> ChannelClient | None:
        """The channel ``delta``'s request came by (None: a stream queue's); its last delta ends the route."""
        ch = self._routes.get(delta.request_id)
        if ch is not None and delta.finished:
            del self._routes[delta.request_id]
        return ch

    def emit(self, delta: Delta) -> None:
        ch = self._channel_for(delta)
        if ch is not None:
            ch.send(("deltas", None, [delta]))
            return
        with self._streams_lock:
            q = self._streams.get(delta.request_id)
        if q is not None:
            q.put(delta)

    def emit_outputs(self, step_outputs) -> None:
        """A step's outputs: one frame per channel, the rest to their stream queues."""
        from engine.sequence import SequenceStatus

        frames: dict[ChannelClient, list[Delta]] = {}
        for out in step_outputs:
            ro, stopped = self.outputs.process(out.seq, out.new_token_ids)
            if stopped:
                self.core.finish(out.seq, SequenceStatus.FINISHED_STOPPED)
                ro.metrics = out.seq.metrics.as_dict()
            delta = Delta.from_output(ro)
            ch = self._channel_for(delta)
            if ch is None:
                self.emit(delta)
            else:
                frames.setdefault(ch, []).append(delta)
        for ch, deltas in frames.items():
            ch.send(("deltas", None, deltas))

    def fail_request(self, request_id: str, error: str) -> None:
        self.outputs.discard(request_id)
        self.emit(Delta(request_id, [], "", "error", error))

    def _release(self, request_id: str) -> None:
        """Free everything the request holds here, without a word to its stream."""
        self.core.abort(request_id)
        self.outputs.discard(request_id)

    def _abort(self, request_id: str) -> None:
        self._release(request_id)
        self.emit(Delta(request_id, [], "", "abort"))

    def _fail(self, request_id: str, error: str) -> None:
        self._release(request_id)
        self.fail_request(request_id, error)

    def _start_profile(self, out_dir: str, with_stack: bool) -> None:
        if self._profile is not None:
            raise RuntimeError(f"{self.replica_id}: a profile is already running")
        window = ProfileWindow(out_dir, self.replica_id, with_stack, cuda=self._is_cuda)
        window.start()
        self._profile = window

    def _stop_profile(self) -> str:
        if self._profile is None:
            raise RuntimeError(f"{self.replica_id}: no profile is running")
        window, self._profile = self._profile, None
        return str(window.stop())

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                has_work = self._iterate()
                self._load = self._snapshot_load()
                wait = 0 if has_work else (self.busy_wait_s if self._has_pending() else self.idle_wait_s)
                self._drain_commands(wait)
        except Exception as e:  # the loop must not die silently: fail every request
            self._fatal = f"{type(e).__name__}: {e}"
            log.error("%s: stage loop died\n%s", self.replica_id, traceback.format_exc())
            with self._streams_lock:
                ids = list(self._streams)
            for rid in ids:
                self.emit(Delta(rid, [], "", "error", f"{self.replica_id} failed: {self._fatal}"))
        finally:
            if self._profile is not None:
                try:
                    self._stop_profile()
                except Exception:
                    log.exception("%s: could not write the open profile", self.replica_id)
            self._on_stop()
            for ch in self._channels:
                ch.close()

    def _drain_commands(self, wait: float) -> None:
        try:
            item = self._commands.get(timeout=wait) if wait > 0 else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, args, fut = item
            try:
                result = fn(*args)
                if fut is not None:
                    fut.set_result(result)
            except Exception as e:
                if fut is not None:
                    fut.set_exception(e)
                else:
                    log.exception("%s: command failed", self.replica_id)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    # ---- the request channel (reader thread, then loop thread) ----------------
    def _channel_ops(self) -> dict[str, Callable]:
        """Channel command -> loop-thread handler ``(channel, request_id, *args)``."""
        return {"abort": lambda ch, rid: self._abort(rid), "fail": lambda ch, rid, error: self._fail(rid, error)}

    def _on_channel_command(self, ch: ChannelClient, msg: tuple) -> None:
        op, rid, *args = msg
        handler = self._channel_ops().get(op)
        if handler is None:
            ch.send(("error", rid, f"{self.replica_id} does not take {op!r}"))
            return
        self.post(handler, ch, rid, *args)

    def _on_channel_lost(self, ch: ChannelClient) -> None:
        self.post(self._drop_channel, ch)

    def _drop_channel(self, ch: ChannelClient) -> None:
        """Nobody is listening for the requests that came by ``ch``: abort them."""
        if ch in self._channels:
            self._channels.remove(ch)
        for rid in [r for r, c in self._routes.items() if c is ch]:
            del self._routes[rid]
            self._abort(rid)

    def _route(self, ch: ChannelClient, request_id: str) -> bool:
        """Send ``request_id``'s outputs by ``ch``; False (and the caller told) if it is already running."""
        with self._streams_lock:
            taken = request_id in self._streams
        if taken or request_id in self._routes:
            ch.send(("error", request_id, f"request_id: {request_id!r} is already running on {self.replica_id}"))
            return False
        self._routes[request_id] = ch
        return True

    def _refuse(self, ch: ChannelClient, request_id: str, error: Exception | str) -> None:
        """Tell the caller a command for ``request_id`` failed; it holds nothing here."""
        self._routes.pop(request_id, None)
        ch.send(("error", request_id, str(error)))

    def _iterate(self) -> bool:
        """One round of the stage's own work; True if there may be more right away."""
        raise NotImplementedError

    def _has_pending(self) -> bool:
        return False

    def _on_stop(self) -> None:
        pass

    # ---- shared status ---------------------------------------------------------
    def _snapshot_load(self) -> dict:
        load = self.core.load()
        load["replica_id"] = self.replica_id
        load["is_alive"] = self._fatal is None
        return load

    def load(self) -> dict:
        """The latest load snapshot (taken by the loop thread after each round)."""
        return dict(self._load, is_alive=self._fatal is None)  # a dead loop takes no more snapshots

    def is_fully_free(self) -> bool:
        return self.call(lambda: self.core.pool.is_fully_free() and not self.core.has_unfinished())

    def cached_block_hashes(self) -> frozenset[int]:
        return frozenset(self.call(self.core.pool.cached_hashes))
