"""The machinery every serving stage shares: a loop thread that owns an
EngineCore, the request channels to the frontend, and the dispatch of their
frames to the stage's handlers.

The stages (prefill, decode, colocated) are plain classes built on this; Ray
hosts them as threaded actors from the launcher. Requests reach a replica
only over its request channel (`engine.serving.channel`): a command frame
comes in on the channel's reader thread, its handler runs on the loop thread
(the only thread that touches the engine), and the request's events go back
on the same channel, one `Deltas` frame per step. Ray calls (load, status,
profiling) read snapshots or run on the loop thread through ``call``.

A stage's loop reads as schedule -> execute -> update (``EngineCore.step``),
with the KV transfer polled, never waited on (``_iterate``).
"""
from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import traceback
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.core import EngineCore, StepOutput
from engine.output import OutputProcessor
from engine.profiling import ProfileWindow, enable_nvtx
from engine.sequence import SequenceStatus
from engine.serving.channel import ChannelClient
from engine.serving.frames import Abort, Deltas, Refused
from engine.serving.types import FinishReason, GenerateDelta, LoadReport

log = logging.getLogger(__name__)

Handler = Callable[[ChannelClient, object], None]


def normal_priority() -> None:
    """Every thread of this process back to niceness 0, where allowed.

    Ray starts its worker processes at niceness 15 (its ``worker_niceness``),
    below every driver and system process. A replica is the workload: at 15,
    whatever else wakes on its host (the frontend forwarding a token, a
    client, Ray's own daemons) takes its core, and every decode step is
    slower for it (BENCHMARKS.md, "Measured design choices"). Threads created
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


def load_engine(model_dir: str | Path, config: EngineConfig, num_threads: int | None = None, ranks=None):
    """EngineCore + tokenizer for a checkpoint folder (already converted). With
    tensor_parallel_size or pipeline_parallel_size > 1 this process is rank 0 and ``ranks`` (an
    `engine.parallel.launch.RankLauncher`; None: spawned children) starts the others."""
    from engine.tokenizer import Tokenizer, TokenizerError
    from engine.weights import load_checkpoint

    normal_priority()  # a replacement loads its model while the other replicas serve: not from niceness 15
    if num_threads:
        torch.set_num_threads(num_threads)
    if config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1:
        from engine.parallel import start_engine

        core = start_engine(model_dir, config, ranks)
    else:
        model_config, weights = load_checkpoint(Path(model_dir), torch.float32, quantization=config.quantization)
        core = EngineCore(model_config, weights, config)
    try:
        tokenizer = Tokenizer.from_folder(model_dir)
        core.eos_token_ids |= frozenset(tokenizer.eos_token_ids)
        core.enable_guided(tokenizer.hf)
    except TokenizerError:
        tokenizer = None
    return core, tokenizer


class StageLoop:
    """Owns the engine on one thread. Subclasses add frame handlers
    (``_handlers``) and implement ``_iterate``."""

    idle_wait_s = 0.05  # how long the loop sleeps on the command queue when there is no work
    busy_wait_s = 0.0005  # ... when transfers are in flight but nothing is runnable

    def __init__(self, replica_id: str, core: EngineCore, tokenizer):
        self.replica_id = replica_id
        self.core = core
        self.tokenizer = tokenizer
        self.outputs = OutputProcessor(tokenizer)
        self._dispatch: dict[type, Handler] = self._handlers()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._channels: list[ChannelClient] = []
        self._routes: dict[str, ChannelClient] = {}  # request id -> the channel it came by (loop thread)
        self._stopped = threading.Event()
        self._fatal: str | None = None
        self._load: LoadReport = self._snapshot_load()
        self._runs = dict(quantization=core.config.quantization,
                          pipeline_parallel_size=core.config.pipeline_parallel_size,
                          kernel_isa=getattr(getattr(core.model, "ops", None), "isa", "none"))  # "none": torch's ops
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

    def connect_channel(self, address: str, secret: bytes) -> None:
        """Dial the frontend's request channel at ``address``
        (`engine.serving.channel`); both ends prove they hold ``secret``.
        Raises if it cannot."""
        self._channels.append(ChannelClient(address, secret, self.replica_id, self.handle, self._on_channel_lost))
        normal_priority()  # the channel's reader thread, started from one of Ray's

    def handle(self, ch, frame) -> None:
        """A command frame from ``ch`` (its reader thread): its handler runs on
        the loop thread; a frame this stage does not take is refused. ``ch``
        is anything with ``send(frame) -> bool``: a `ChannelClient`, or a test's
        in-process channel."""
        handler = self._dispatch.get(type(frame))
        if handler is None:
            ch.send(Refused(getattr(frame, "request_id", ""),
                            f"{self.replica_id} does not take {type(frame).__name__}"))
            return
        self.post(handler, ch, frame)

    def start_profile(self, out_dir: str, with_stack: bool = False) -> None:
        """Open a profiler window on the loop thread (CPU, plus CUDA on a GPU).
        Raises if one is already open on this replica."""
        self.call(self._start_profile, out_dir, with_stack)

    def stop_profile(self) -> list[str]:
        """Close the window; returns the Chrome trace of each rank on this host, rank 0 first:
        ``<out_dir>/<replica_id>-<timestamp>.json``, then (tensor-parallel)
        ``<out_dir>/<replica_id>-rank<r>-<timestamp>.json``."""
        return self.call(self._stop_profile, timeout=300.0)

    def host(self) -> str:
        """This replica's host name (where its trace files are written)."""
        return socket.gethostname()

    def load(self) -> LoadReport:
        """The latest load snapshot (taken by the loop thread after each round), with what
        the replica runs: its weights' format and kernel ISA path."""
        if self._fatal is not None:  # a dead loop takes no more snapshots
            return LoadReport(self.replica_id, is_alive=False, error=self._fatal, **self._runs)
        return replace(self._load, **self._runs)

    def rank_pids(self) -> list[int]:
        """The process of each tensor-parallel rank, rank 0 (this one) first; [this one] at TP=1."""
        group = self.core.tp_group
        return [os.getpid()] + (group.pids if group is not None else [])

    def is_fully_free(self) -> bool:
        """Every block back in the pool and no request left here."""
        return self.call(self._is_fully_free)

    def cached_block_hashes(self) -> frozenset[int]:
        return self.call(self.core.cached_block_hashes)

    def stop(self) -> None:
        self._stopped.set()
        self._commands.put((lambda: None, (), None))
        self._thread.join(timeout=10)

    def close(self) -> None:
        self.stop()

    # ---- frame handlers (loop thread) ------------------------------------------
    def _handlers(self) -> dict[type, Handler]:
        """Command frame type -> its handler ``(channel, frame)``; stages add theirs."""
        return {Abort: lambda ch, f: self._abort(f.request_id)}

    def _route(self, ch, request_id: str) -> bool:
        """Send ``request_id``'s outputs by ``ch``; False (and the caller told) if it is already running."""
        if request_id in self._routes:
            ch.send(Refused(request_id, f"request_id: {request_id!r} is already running on {self.replica_id}"))
            return False
        self._routes[request_id] = ch
        return True

    def _refuse(self, ch, request_id: str, error: Exception | str) -> None:
        """Tell the caller a command for ``request_id`` failed; it holds nothing here."""
        self._routes.pop(request_id, None)
        ch.send(Refused(request_id, str(error)))

    # ---- outputs (loop thread) ---------------------------------------------
    def emit(self, delta: GenerateDelta) -> None:
        """One delta to the channel its request came by; its last ends the route."""
        ch = self._routes.get(delta.request_id)
        if ch is None:
            return
        if delta.is_finished:
            del self._routes[delta.request_id]
        ch.send(Deltas([delta]))

    def emit_outputs(self, step_outputs: Iterable[StepOutput]) -> None:
        """A step's outputs as deltas: one frame per channel."""
        frames: dict[ChannelClient, list[GenerateDelta]] = {}
        for out in step_outputs:
            if out.seq.status == SequenceStatus.FINISHED_ERROR:  # its grammar: the input's fault, not the replica's
                self.outputs.discard(out.seq.request_id)
                ch = self._routes.get(out.seq.request_id)
                if ch is not None:
                    self._refuse(ch, out.seq.request_id, out.seq.error)
                continue
            delta, stopped = self.outputs.process(out.seq, out.new_token_ids)
            if stopped:
                self.core.finish(out.seq, SequenceStatus.FINISHED_STOPPED)
                delta.timings = out.seq.metrics.timings()
            rid = out.seq.request_id
            ch = self._routes.get(rid)
            if ch is None:
                continue
            if delta.is_finished:
                del self._routes[rid]
            frames.setdefault(ch, []).append(delta)
        for ch, deltas in frames.items():
            ch.send(Deltas(deltas))

    def fail_request(self, request_id: str, error: str) -> None:
        self.outputs.discard(request_id)
        self.emit(GenerateDelta(request_id, finish_reason=FinishReason.ERROR, error=error))

    def _release(self, request_id: str) -> None:
        """Free everything the request holds here, without a word to its channel."""
        self.core.abort(request_id)
        self.outputs.discard(request_id)

    def _abort(self, request_id: str) -> None:
        self._release(request_id)
        self.emit(GenerateDelta(request_id, finish_reason=FinishReason.ABORT))

    def _is_fully_free(self) -> bool:
        return self.core.is_idle()

    # ---- the loop --------------------------------------------------------------
    def _start_profile(self, out_dir: str, with_stack: bool) -> None:
        if self._profile is not None:
            raise RuntimeError(f"{self.replica_id}: a profile is already running")
        window = ProfileWindow(out_dir, self.replica_id, with_stack, cuda=self._is_cuda)
        window.start()
        self._profile = window
        if self.core.tp_group is not None:  # a trace per rank
            self.core.tp_group.start_profile(out_dir, self.replica_id, with_stack)

    def _stop_profile(self) -> list[str]:
        if self._profile is None:
            raise RuntimeError(f"{self.replica_id}: no profile is running")
        window, self._profile = self._profile, None
        paths = [str(window.stop())]
        if self.core.tp_group is not None:
            paths += self.core.tp_group.stop_profile()
        return paths

    def _run(self) -> None:
        group = self.core.tp_group
        try:
            while not self._stopped.is_set():
                if group is not None:
                    group.check_ranks()  # a dead rank takes the replica down, busy or idle
                has_work = self._iterate()
                self._load = self._snapshot_load()
                wait = 0 if has_work else (self.busy_wait_s if self._has_pending() else self.idle_wait_s)
                self._drain_commands(wait)
        except Exception as e:  # the loop must not die silently: fail every request
            self._fatal = f"{type(e).__name__}: {e}"
            log.error("%s: stage loop died\n%s", self.replica_id, traceback.format_exc())
            for rid in list(self._routes):
                self.fail_request(rid, f"{self.replica_id} failed: {self._fatal}")
        finally:
            if self._profile is not None:
                try:
                    self._stop_profile()
                except Exception:
                    log.exception("%s: could not write the open profile", self.replica_id)
            self._on_stop()
            for ch in self._channels:
                ch.close()
            self.core.close()  # the other tensor-parallel ranks, if any

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

    def _on_channel_lost(self, ch: ChannelClient) -> None:
        self.post(self._drop_channel, ch)

    def _drop_channel(self, ch) -> None:
        """Nobody is listening for the requests that came by ``ch``: abort them."""
        if ch in self._channels:
            self._channels.remove(ch)
        for rid in [r for r, c in self._routes.items() if c is ch]:
            del self._routes[rid]
            self._abort(rid)

    def _iterate(self) -> bool:
        """One round of the stage's own work; True if there may be more right away."""
        raise NotImplementedError

    def _has_pending(self) -> bool:
        return False

    def _on_stop(self) -> None:
        pass

    def _snapshot_load(self) -> LoadReport:
        return self.core.load(self.replica_id)
