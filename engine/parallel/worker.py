"""A tensor-parallel rank other than 0: a process (spawned by rank 0, or a Ray actor of the
replica; engine.parallel.launch) that runs its shard of every step.

Life cycle (rank 0's engine.parallel.group.TPGroup drives it):

1. attach: map the shared segment (and join gloo or NCCL, with those backends, and with
   pipeline parallelism make the stages' links, engine.parallel.pipe.DistLinks; on CUDA
   the rank's GPU is chosen by engine.parallel.devices);
2. load: read this rank's shard of the checkpoint, build the model on it (on its device);
3. init: take the KV cache size from rank 0's first message, map this rank's
   cache (its KV heads only) from the shared-memory file rank 0 made for it
   (engine.parallel.kv_shm; CUDA: allocated on its GPU and exported as CUDA IPC
   handles, engine.parallel.kv_ipc), report ready with its memory figures (and the handles);
4. run: for each step message, rebuild the batch from the mirrored block
   tables, run the forward (joining every all-reduce) and, where the batch
   samples, hand its vocabulary slice of the logits to rank 0; with pipeline
   parallelism (engine.parallel.pipe), a rank of a later stage takes the batch's
   hidden states from the stage before, a stage's leader hands its own on (or, on
   the last stage, the batch's logits rows back to rank 0);
   (between steps, a profile message opens or closes this rank's profiler window);
5. stop: on STOP, on an abort, or when rank 0's process is gone (its parent, or
   ``leader_pid`` watched through a pidfd).

Errors are sent to rank 0 over the pipe, and the group is aborted so that no
rank waits for this one. SIGINT is ignored: Ctrl-C reaches rank 0, which
tears the group down.
"""
from __future__ import annotations

import json
import os
import signal
import traceback
from dataclasses import dataclass

import numpy as np
import torch

from engine.config import EngineConfig
from engine.parallel.kv_ipc import SharedKV
from engine.parallel.shm import SegmentLayout

INIT = 3
PROFILE = 4  # [PROFILE, is_start, with_stack, n, 0] + n bytes of JSON {"out_dir", "name"}


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    size: int
    model_dir: str
    config: EngineConfig
    segment: str
    layout: SegmentLayout
    num_threads: int
    dist_init_method: str | None  # torch.distributed's rendezvous, with tp_backend gloo or nccl
    oversubscribed: bool  # more ranks than cores
    leader_pid: int | None = None  # rank 0's process where it is not this one's parent (a Ray actor)
    devices_isolated: bool = False  # each rank sees only its own GPU (Ray): engine.parallel.devices


@dataclass(frozen=True)
class RankMemory:
    weight_bytes: int  # the model's weights as this rank holds them
    rss_anon_bytes: int  # private resident memory (RssAnon): weights, torch, KV cache
    peak_rss_bytes: int  # VmHWM: peak resident, checkpoint pages read through the file mapping included


# What a worker tells rank 0 over its pipe, in order: Attached, then Ready (then a Traced per
# closed profile window); Failed at any point.
@dataclass(frozen=True)
class Attached:
    pass


@dataclass(frozen=True)
class Ready:
    memory: RankMemory
    kv: "SharedKV | None" = None  # CUDA: this rank's cache as IPC handles, for rank 0 (engine.parallel.kv_ipc)


@dataclass(frozen=True)
class Traced:
    path: str  # this rank's Chrome trace, after a profile window closed


@dataclass(frozen=True)
class Failed:
    error: str  # the exception and its traceback


def init_message(num_blocks: int) -> bytes:
    return np.asarray([INIT, num_blocks, 0, 0, 0], dtype=np.int64).tobytes()


def profile_message(is_start: bool, out_dir: str = "", name: str = "", with_stack: bool = False) -> bytes:
    """Open (``is_start``) or close every other rank's profiler window, between steps; each
    rank writes ``<out_dir>/<name>-rank<r>-<timestamp>.json`` and reports it (`Traced`)."""
    body = json.dumps({"out_dir": out_dir, "name": name}).encode()
    return np.asarray([PROFILE, int(is_start), int(with_stack), len(body), 0], dtype=np.int64).tobytes() + body


def _profile(payload: bytes, window, rank: int, conn):
    """Apply a profile message; returns the open window (or None)."""
    from engine.profiling import ProfileWindow

    _, is_start, with_stack, n, _ = np.frombuffer(payload[:40], dtype=np.int64).tolist()
    if is_start:
        args = json.loads(bytes(payload[40:40 + n]))
        window = ProfileWindow(args["out_dir"], f"{args['name']}-rank{rank}", bool(with_stack))
        window.start()
        return window
    conn.send(Traced(str(window.stop()) if window is not None else ""))
    return None


def memory_report(model) -> RankMemory:
    """What this process holds: the model's weight bytes, its private resident memory now
    (RssAnon: the checkpoint pages it read through the file mapping are not counted) and its
    peak resident memory (VmHWM: those pages included)."""
    from engine.kernels import PackedWeight

    seen, weight_bytes = set(), 0
    tensors = [model.embed, model.lm_head, model.norm] + [getattr(L, n) for L in model.layers for n in L.__slots__]
    for t in tensors:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        weight_bytes += t.nbytes if isinstance(t, PackedWeight) else t.numel() * t.element_size()
    weight_bytes += sum(m.nbytes for m in getattr(model, "moe", ()) if m is not None)  # experts (engine/moe.py)
    status = {}
    try:
        for line in open("/proc/self/status"):
            key, _, value = line.partition(":")
            if key in ("RssAnon", "VmHWM"):
                status[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    # VmHWM, not getrusage's ru_maxrss: that one carries the spawning parent's peak across exec
    return RankMemory(weight_bytes, status.get("RssAnon", 0), status.get("VmHWM", 0))


def _run_stage(pipe, model, k: int, input_ids, positions, meta, kv_caches, sample_rows, argmax: bool,
               scores) -> None:
    """Batch k on this rank's pipeline stage (engine.parallel.pipe). With `argmax` (every sampled
    row plain greedy), the last stage returns the rows' tokens instead of their logits; after
    them, the results of the prompt positions it scores (``scores``, engine.runner.PromptScores)."""
    from engine.runner import score_rows

    inputs = None
    if not pipe.is_first:
        inputs = pipe.recv_hidden(k, input_ids.shape[0], model.cfg.hidden_size, model.dtype)
    hidden = model.forward(input_ids, positions, meta, kv_caches, hidden=inputs)
    if not pipe.is_last:
        if pipe.is_leader:
            pipe.send_hidden(k, hidden)
            pipe.mark_done(k)
        return
    if pipe.is_leader:
        pipe.mark_done(k)
    scored = score_rows(model, hidden, scores) if scores is not None else None  # (as rank 0's runner, first)
    logits = model.compute_logits(hidden[sample_rows]) if sample_rows else None  # gathered to the leader
    if pipe.is_leader:
        if argmax and logits is not None:  # int32 ids in the float32 slot, bit for bit (runner.PPRunner.collect)
            logits = logits.argmax(dim=-1).to(torch.int32).view(torch.float32)
        parts = [x.float().reshape(-1) for x in (logits, scored) if x is not None]
        pipe.send_logits(k, torch.cat(parts) if parts else None)


def worker_main(spec: WorkerSpec, conn) -> None:
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread (a Ray actor's call): Ctrl-C does not reach it anyway
        pass
    parent = os.getppid()
    shm = dist = kv_path = None
    try:
        from engine.core import pick_dtype
        from engine.kv_cache import KVCacheSpec, allocate_kv_cache, torch_dtype
        from engine.model import LlamaModel
        from engine.parallel.comm import SINGLE, dist_collectives
        from engine.parallel.devices import cuda_device_count, rank_device
        from engine.parallel.sharding import ShardLayout, load_shard
        from engine.parallel.shm import ShmGroup
        from engine.parallel.step import STOP, StepDecoder
        from engine.runner import ModelRunner, score_rows
        from engine.weights import read_config

        torch.set_num_threads(spec.num_threads)
        config = spec.config
        device = rank_device(config.device, spec.rank, spec.size,
                             cuda_device_count() if config.device.startswith("cuda") else 0, spec.devices_isolated)
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        if spec.leader_pid is None:
            peers_alive = lambda: os.getppid() == parent  # noqa: E731
        else:
            from engine.parallel.launch import PidWatch

            peers_alive = PidWatch(spec.leader_pid).is_alive
        tp = config.tensor_parallel_size
        stage = spec.rank // tp
        shm = ShmGroup(spec.segment, spec.layout, spec.rank, config.tp_timeout_s,
                       peers_alive=peers_alive, oversubscribed=spec.oversubscribed,
                       group=range(stage * tp, (stage + 1) * tp))
        conn.send(Attached())
        links = None
        if spec.dist_init_method is not None:
            dist = dist_collectives(config.tp_comm_backend, spec.rank, spec.size, spec.dist_init_method,
                                    config.tp_timeout_s, device, tp=tp)
            if config.pipeline_parallel_size > 1:  # (every rank makes them now, in one order)
                from engine.parallel.pipe import DistLinks

                links = DistLinks(dist, spec.layout, device)
        comm = (dist or shm) if tp > 1 else SINGLE
        cfg = read_config(spec.model_dir)
        layout = ShardLayout.for_engine(cfg, spec.rank, config)
        _, weights = load_shard(spec.model_dir, layout, torch.float32)
        dtype_name = pick_dtype(config.dtype, config.device)
        max_len = config.max_model_len or cfg.max_position_embeddings
        model = LlamaModel(cfg, weights, torch_dtype(dtype_name), device, max_positions=max_len,
                           kernel_isa=config.kernel_isa, shard=layout, comm=comm, moe_dispatch=config.moe_dispatch)
        del weights
        init = np.frombuffer(shm.recv(), dtype=np.int64)
        if init[0] == STOP:  # rank 0 gave up while starting
            return
        if init[0] != INIT:
            raise RuntimeError(f"rank {spec.rank}: expected the init message, got kind {init[0]}")
        kv_spec = KVCacheSpec.for_model(cfg, config.block_size, dtype_name, num_kv_heads=layout.num_kv_heads,
                                        num_layers=len(layout.layers))
        if config.device == "cpu":  # in shared memory, so that rank 0's KV transfer endpoint maps it too
            from engine.parallel.kv_shm import kv_segment_path, map_kv_cache

            kv_path = kv_segment_path(spec.segment, spec.rank)
            kv_caches = map_kv_cache(kv_path, kv_spec, int(init[1]))
        else:
            kv_caches = allocate_kv_cache(kv_spec, int(init[1]), device, prefault=config.kv_cache_prefault)
        runner = ModelRunner(model, kv_caches, config.block_size)
        shared = None
        if device.startswith("cuda"):  # rank 0's KV endpoint opens them; they stay valid while this process runs
            from engine.parallel.kv_ipc import export_kv

            torch.cuda.synchronize(device)
            shared = export_kv(spec.rank, kv_caches)
        conn.send(Ready(memory_report(model), shared))
        decoder = StepDecoder()
        window = None
        pipe = None
        if config.pipeline_parallel_size > 1:
            from engine.parallel.pipe import StageChannel

            pipe = StageChannel(shm, spec.rank, links)
            pipe.share_expert_counts(model)
        num_batches = 0
        with torch.no_grad():
            while True:
                payload = shm.recv()
                if np.frombuffer(payload[:8], dtype=np.int64)[0] == PROFILE:
                    window = _profile(payload, window, spec.rank, conn)
                    continue
                step = decoder.decode(payload)
                if step is None:
                    break
                rows, scores = step
                num_batches += 1
                input_ids, positions, meta, sample_rows = runner.prepare(rows)
                if pipe is None:  # this rank's vocabulary slice of each LM-head call, to rank 0
                    hidden = model.forward(input_ids, positions, meta, kv_caches)
                    if scores is not None:
                        score_rows(model, hidden, scores)
                    if sample_rows:
                        model.compute_logits(hidden[sample_rows])
                    continue
                argmax = all(r.argmax for r in rows if r.samples)
                _run_stage(pipe, model, num_batches, input_ids, positions, meta, kv_caches, sample_rows, argmax,
                           scores)
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, which decides
        if shm is not None:
            shm.abort()
        try:
            conn.send(Failed(f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        except (OSError, ValueError):
            pass
    finally:
        if kv_path is not None:  # rank 0 unlinks it once every rank is ready; this covers a rank 0 killed before
            from engine.parallel.kv_shm import unlink_kv_segment

            unlink_kv_segment(kv_path)
        if dist is not None:
            dist.close()
        conn.close()
