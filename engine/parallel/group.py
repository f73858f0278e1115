"""Rank 0's handle on a tensor-parallel group on one host: the worker processes, the
shared segment, the collectives, and their teardown. With pipeline parallelism the group
holds pp * tp ranks (rank = pp_rank * tp + tp_rank): every stage a tensor-parallel group
of its own inside the one segment, the stages handing activations on through it
(engine.parallel.pipe); `rank_layers` says each rank's global layers.

    group = TPGroup(model_dir, config, model_config)   # creates the segment, starts ranks 1..N-1
    ... rank 0 builds its own shard of the model (EngineCore) ...
    group.finish_start(num_blocks, kv_caches)          # every rank maps its cache; all ready
    group.rank_kv_caches()                             # rank -> its local layer -> KV tensor (for the KV
                                                       #   transfer; CPU: shared files, CUDA: IPC handles)
    group.rank_layers()                                # rank -> its global layers (range)
    group.send_step(payload)                           # once per step (engine.parallel.step)
    group.close()                                      # STOP, join; or abort and kill

Ranks 1..N-1 are started by a launcher (engine.parallel.launch): spawned
children by default, the replica's Ray actors in the cluster.

Teardown is also registered with `weakref.finalize`, so garbage collection
and interpreter exit close the group too; a failed step (an exception, a
dead or stuck rank, Ctrl-C) aborts it. No worker outlives it, and the
segment's file is unlinked as soon as every rank has mapped it (before that,
by teardown), and so are the workers' KV cache files (engine.parallel.kv_shm).
A worker whose rank 0 vanished (SIGKILL) notices within milliseconds and
exits.
"""
from __future__ import annotations

import logging
import os
import socket
import time
import weakref

from engine.config import EngineConfig, ModelConfig
from engine.parallel.comm import SINGLE, CollectiveError, dist_collectives
from engine.parallel.devices import cuda_device_count, rank_device
from engine.parallel.launch import RankLauncher, SpawnLauncher
from engine.parallel.kv_shm import create_kv_segment, kv_segment_path, map_kv_cache, unlink_kv_segment
from engine.parallel.pipe import DistLinks, StageChannel
from engine.parallel.sharding import ShardLayout
from engine.parallel.shm import SegmentLayout, ShmGroup, create_segment, unlink_segment
from engine.parallel.step import stop_message
from engine.parallel.worker import (Attached, Failed, RankMemory, Ready, Traced, WorkerSpec, init_message,
                                   profile_message)
from engine.runner import SCORE_WIDTH

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # loading a shard of a large checkpoint
JOIN_TIMEOUT_S = 5.0


def segment_layout(config: EngineConfig, model_config: ModelConfig) -> SegmentLayout:
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    shard = ShardLayout.for_engine(model_config, 0, config)
    max_len = config.max_model_len or model_config.max_position_embeddings
    max_blocks = -(-max_len // config.block_size)
    rows = max(config.max_num_seqs, 1)
    # header; per batch row a drop, a table diff and the row; the tokens; drops of sequences not in the batch;
    # the prompt positions scored (a row and a target per token at most)
    ctrl_ints = 5 + rows * (1 + 3 + max_blocks + 4) + config.max_num_batched_tokens + 4 * rows + \
        2 + 2 * config.max_num_batched_tokens
    # the hand-offs' slots; none where their payloads go over gloo or NCCL (engine.parallel.pipe.DistLinks)
    in_segment = config.tp_comm_backend == "shm"
    pipe = dict(pp=pp, act_bytes=config.max_num_batched_tokens * model_config.hidden_size * 4 * in_segment,
                # (a batch's sampled logits rows, then its scored prompt positions: engine.runner.score_rows)
                ret_bytes=(rows * model_config.vocab_size + config.max_num_batched_tokens * SCORE_WIDTH) * 4
                * in_segment,
                counts_bytes=8 * len(model_config.moe_layers) * model_config.num_experts) if pp > 1 else {}
    return SegmentLayout.make(
        pp * tp,
        ar_bytes=min(config.max_num_batched_tokens * model_config.hidden_size * 4, 16 << 20),
        gather_bytes=min(rows * shard.vocab_shard * 4, 16 << 20),
        ctrl_bytes=8 * ctrl_ints, **pipe)


def threads_per_rank(tp: int) -> int:
    return max(1, len(os.sched_getaffinity(0)) // tp)


def is_oversubscribed(tp: int) -> bool:
    return tp > len(os.sched_getaffinity(0))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _State:
    """What teardown needs, without a reference to the TPGroup (so finalize can run)."""

    def __init__(self, segment: str):
        self.segment = segment
        self.is_unlinked = False
        self.procs: list = []
        self.conns: list = []
        self.shm: ShmGroup | None = None
        self.dist = None  # engine.parallel.comm's gloo or NCCL collectives, with those backends
        self.is_healthy = True
        self.is_closed = False
        self.num_threads: int | None = None  # this process's torch threads before the group set its own
        self.kv_paths: list[str] = []  # the workers' KV cache files, until unlinked
        self.rank_kv: list[list] = []  # rank -> layer -> KV tensor, once every rank is ready
        self.rank_kv_error: str | None = None  # why rank_kv is empty on a group that started (CUDA)
        self.peer_devices: list = []  # CUDA: the other ranks' GPUs, as this process opened their caches

    def unlink_kv(self) -> None:
        for path in self.kv_paths:
            unlink_kv_segment(path)
        self.kv_paths = []

    def unlink(self) -> None:
        if not self.is_unlinked:
            unlink_segment(self.segment)
            self.is_unlinked = True

    def teardown(self) -> None:
        if self.is_closed:
            return
        self.is_closed = True
        self.rank_kv, self.peer_devices = [], []  # before the workers go: CUDA IPC views are released
        try:
            if self.shm is not None:
                if self.is_healthy:
                    # a stop cut into a step (Ctrl-C mid-collective) may find the step channel full
                    # of a message a worker, itself waiting on this rank, never acks: wait no longer
                    # for it than for a join, then abort, rather than the whole collective timeout
                    self.shm.timeout_s = min(self.shm.timeout_s, JOIN_TIMEOUT_S)
                    try:
                        self.shm.send(stop_message())
                    except CollectiveError:  # a rank went between steps
                        self.is_healthy = False
                        self.shm.abort()
                else:
                    self.shm.abort()
            # an aborted worker exits as soon as it sees the flag; one that does not is stuck or stopped
            deadline = time.monotonic() + (JOIN_TIMEOUT_S if self.is_healthy else 1.0)
            for p in self.procs:
                p.join(max(0.0, deadline - time.monotonic()))
            if self.is_healthy and any(p.is_alive() for p in self.procs) and self.shm is not None:
                self.shm.abort()  # stuck in a collective: make it raise
                for p in self.procs:
                    p.join(1.0)
            for p in self.procs:
                if p.is_alive():
                    p.kill()
                    p.join(JOIN_TIMEOUT_S)
        finally:
            if self.num_threads is not None:
                import torch

                torch.set_num_threads(self.num_threads)
            self.unlink()
            self.unlink_kv()  # (CPU: the mappings go with the last tensor that views them)
            for c in self.conns:
                c.close()
            if self.dist is not None:
                self.dist.close()
            if self.shm is not None:
                self.shm.close()


class TPGroup:
    def __init__(self, model_dir: str, config: EngineConfig, model_config: ModelConfig,
                 launcher: RankLauncher | None = None):
        world = config.tensor_parallel_size * config.pipeline_parallel_size  # every rank of the replica
        self.size = world
        self.tp_size = config.tensor_parallel_size
        self.config, self.model_config = config, model_config
        self.layout = segment_layout(config, model_config)
        self.state = state = _State(create_segment(self.layout))
        self._finalizer = weakref.finalize(self, state.teardown)
        self.rank_memory: dict[int, RankMemory] = {}  # ranks 1.. as they reported when ready
        try:
            launcher = launcher or SpawnLauncher()
            backend = config.tp_comm_backend
            isolated = launcher.isolates_devices
            launcher.see_devices(config.device)
            if config.device.startswith("cuda"):  # every rank's GPU exists (offline: refused naming both counts)
                self.device = rank_device(config.device, 0, world, cuda_device_count(), isolated)
                rank_device(config.device, world - 1, world, cuda_device_count(), isolated)
            else:
                self.device = config.device
            init = f"tcp://127.0.0.1:{_free_port()}" if backend in ("gloo", "nccl") else None
            threads = launcher.num_threads or threads_per_rank(world)
            specs = [WorkerSpec(rank, world, str(model_dir), config, state.segment, self.layout, threads, init,
                                is_oversubscribed(world), devices_isolated=isolated) for rank in range(1, world)]
            for p, conn in launcher.start(specs, config.tp_timeout_s + 60.0):
                state.procs.append(p)
                state.conns.append(conn)
            procs = state.procs  # (not self: the finalizer must not keep the group alive)
            state.shm = ShmGroup(state.segment, self.layout, 0, config.tp_timeout_s,
                                 peers_alive=lambda: all(p.exitcode is None for p in procs),
                                 oversubscribed=is_oversubscribed(world), group=range(self.tp_size))
            self._await(Attached, config.tp_timeout_s + 60.0)
            state.unlink()  # every rank maps it: the file is not needed any more
            links = None
            if init is not None:
                state.dist = dist_collectives(backend, 0, world, init, config.tp_timeout_s, self.device,
                                              tp=self.tp_size)
                if config.pipeline_parallel_size > 1:  # (every rank makes them now, in one order)
                    links = DistLinks(state.dist, self.layout, self.device)
            # the model's collectives: over its stage's ranks (none with one rank a stage)
            self.comm = (state.dist or state.shm) if self.tp_size > 1 else SINGLE
            # rank 0's end of the stages' hand-offs (engine.parallel.pipe): payloads over gloo or NCCL
            # with those backends, through the segment with shm
            self.pipe = StageChannel(state.shm, 0, links) if config.pipeline_parallel_size > 1 else None
            import torch

            state.num_threads = torch.get_num_threads()
            torch.set_num_threads(threads)  # rank 0 runs in this process: its share of the cores, until close
        except BaseException:
            self.close()
            raise

    def _await(self, what: type, timeout_s: float) -> list:
        """Each worker's next message must be a `what` (returned, in rank order); a worker's
        failure is raised here."""
        name = what.__name__.lower()
        got = []
        deadline = time.monotonic() + timeout_s
        for rank, (p, conn) in enumerate(zip(self.state.procs, self.state.conns), start=1):
            while not conn.poll(0.05):
                if p.exitcode is not None:
                    raise CollectiveError(f"tensor-parallel rank {rank} exited (code {p.exitcode}) while starting")
                if time.monotonic() > deadline:
                    raise CollectiveError(f"tensor-parallel rank {rank}: not {name} after {timeout_s:g} s")
            try:
                msg = conn.recv()
            except EOFError:
                p.join(1.0)
                raise CollectiveError(f"tensor-parallel rank {rank} exited (code {p.exitcode}) while starting; "
                                      "a script that starts ranks needs an `if __name__ == '__main__':` guard "
                                      "(multiprocessing spawn imports it again)") from None
            if isinstance(msg, Failed):
                raise CollectiveError(f"tensor-parallel rank {rank} failed while starting: {msg.error}")
            if not isinstance(msg, what):
                raise CollectiveError(f"tensor-parallel rank {rank}: expected {name}, got {type(msg).__name__}")
            if isinstance(msg, Ready):
                self.rank_memory[rank] = msg.memory
            got.append(msg)
        return got

    def finish_start(self, num_blocks: int, kv_caches: list | None = None) -> None:
        """Rank 0's shard and cache (``kv_caches``) are built: the others size their caches alike, in
        shared memory that rank 0 maps too (CPU); wait for all."""
        try:
            mapped = self._create_kv_caches(num_blocks)
            self.state.shm.send(init_message(num_blocks))
            ready = self._await(Ready, START_TIMEOUT_S)
            self.state.unlink_kv()  # every rank maps its cache
            if mapped is None and all(r.kv is not None for r in ready):
                mapped = self._import_kv_caches(num_blocks, ready)
            if kv_caches is not None and mapped is not None:
                self.state.rank_kv = [list(kv_caches), *mapped]
                self.state.peer_devices = sorted({t.device for r in mapped for t in r if t.is_cuda}, key=str)
        except BaseException:
            self.fail()
            raise

    def start_profile(self, out_dir: str, name: str, with_stack: bool = False) -> None:
        """Open a profiler window on every other rank (call between steps, from the thread that
        steps); each writes ``<out_dir>/<name>-rank<r>-<timestamp>.json``."""
        self.send_step(profile_message(True, out_dir, name, with_stack))

    def stop_profile(self, timeout_s: float = 300.0) -> list[str]:
        """Close the windows; the other ranks' trace paths, rank 1 first (each exports its own)."""
        self.send_step(profile_message(False))
        try:
            return [m.path for m in self._await(Traced, timeout_s)]
        except BaseException:
            self.fail()
            raise

    def _rank_kv_spec(self, rank: int):
        from engine.core import pick_dtype
        from engine.kv_cache import KVCacheSpec

        dtype = pick_dtype(self.config.dtype, self.config.device)
        shard = ShardLayout.for_engine(self.model_config, rank, self.config)
        return KVCacheSpec.for_model(self.model_config, self.config.block_size, dtype,
                                     num_kv_heads=shard.num_kv_heads, num_layers=len(shard.layers))

    def rank_layers(self) -> list[range]:
        """rank -> the global layers its cache and weights hold (all of them at pipeline_parallel_size 1);
        `rank_kv_caches()[r][j]` is layer `rank_layers()[r][j]`."""
        return [ShardLayout.for_engine(self.model_config, r, self.config).layers for r in range(self.size)]

    def _import_kv_caches(self, num_blocks: int, ready: list[Ready]) -> list[list] | None:
        """CUDA: open each worker's exported cache (engine.parallel.kv_ipc). One that rank 0 cannot
        open (a GPU it does not see) leaves the group serving; only `rank_kv_caches` raises, naming why."""
        from engine.parallel.kv_ipc import import_kv

        try:
            out = []
            for rank, msg in enumerate(ready, start=1):
                spec = self._rank_kv_spec(rank)
                out.append(import_kv(msg.kv, (num_blocks, *spec.block_shape), spec.dtype, spec.num_layers))
            return out
        except RuntimeError as e:
            log.warning("tensor-parallel KV caches not shared with rank 0: %s", e)
            self.state.rank_kv_error = str(e)
            return None

    def _create_kv_caches(self, num_blocks: int) -> list[list] | None:
        """Each worker rank's cache file, created and mapped here (the worker maps it at init)."""
        if self.config.device != "cpu":
            return None  # CUDA: each worker allocates its own and shares IPC handles (_import_kv_caches)
        mapped = []
        for rank in range(1, self.size):
            spec = self._rank_kv_spec(rank)
            path = kv_segment_path(self.state.segment, rank)
            create_kv_segment(path, spec, num_blocks, rank, prefault=self.config.kv_cache_prefault)
            self.state.kv_paths.append(path)
            mapped.append(map_kv_cache(path, spec, num_blocks))
        return mapped

    def rank_kv_caches(self) -> list[list]:
        """rank -> its local layer (`rank_layers`) -> that rank's KV cache tensor
        (``[num_blocks, 2, block_size, its heads, head_dim]``),
        rank 0's own and the others' mapped from their shared memory (CPU) or opened from their CUDA IPC
        handles (each on its rank's GPU): what the replica's one KV transfer endpoint reads (prefill) or
        writes (decode). Valid while the group is up."""
        self.check()
        if not self.state.rank_kv:
            raise RuntimeError("rank_kv_caches: " + (self.state.rank_kv_error
                                                     or "the group has not finished starting"))
        return self.state.rank_kv

    def send_step(self, payload: bytes) -> None:
        self.check()
        self.state.shm.send(payload)

    def finish_peer_writes(self) -> None:
        """CUDA: wait for what this process queued on the other ranks' GPUs (the KV receiver's copies into
        their caches, through the IPC views), so that a rank's next step reads them complete: another
        process's kernels are not ordered after this one's streams. A no-op on CPU."""
        if self.state.peer_devices:
            import torch

            for device in self.state.peer_devices:
                torch.cuda.synchronize(device)

    def check(self) -> None:
        """Raise where the group can no longer run a step."""
        if self.state.is_closed or not self.state.is_healthy:
            raise CollectiveError("the tensor-parallel group is down (a rank failed or it was closed)")

    def check_ranks(self) -> None:
        """Raise (and tear the group down) where a rank's process is gone, even between steps:
        a serving replica calls it each round, so a dead rank takes the replica down at once."""
        self.check()
        gone = self.gone_ranks()
        if gone is not None:
            cause = self.worker_error()
            self.fail()
            raise CollectiveError(f"tensor-parallel {gone}" + (f" ({cause})" if cause else ""))

    def gone_ranks(self) -> str | None:
        """Which ranks' processes are gone, if any: ``rank 1 (pid 123) is gone``."""
        gone = [f"rank {rank} (pid {p.pid})" for rank, p in enumerate(self.state.procs, start=1)
                if p.exitcode is not None]
        return f"{', '.join(gone)} {'is' if len(gone) == 1 else 'are'} gone" if gone else None

    def worker_error(self, wait_s: float = 0.0) -> str | None:
        """The first error a worker reported, if any (after a failed collective), waiting up to
        ``wait_s`` for one (a rank that aborted the group reports why just after)."""
        deadline = time.monotonic() + wait_s
        while True:
            cause = self._worker_error()
            if cause is not None or time.monotonic() >= deadline:
                return cause
            time.sleep(0.01)

    def _worker_error(self) -> str | None:
        for rank, conn in enumerate(self.state.conns, start=1):
            try:
                if conn.poll(0):
                    msg = conn.recv()
                    if isinstance(msg, Failed):
                        return f"rank {rank}: {msg.error}"
            except (OSError, EOFError):
                continue
        return None

    def fail(self) -> None:
        """A step failed part-way (the ranks' collectives are out of step): abort and tear down."""
        self.state.is_healthy = False
        self.close()

    def close(self) -> None:
        self._finalizer()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.state.procs]
