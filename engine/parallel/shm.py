"""Collectives between the ranks on one host through one shared-memory segment.

gloo on CPU goes through TCP even between processes on one host: two round
trips per all-reduce, two all-reduces per layer per step. Here every rank
writes its part into its own slot of a shared segment, raises its flag, waits
for every other flag, and sums the slots in rank order (so every rank gets
the same bits, fp32 accumulation for bf16). Flags are int64 generation
counters, each on its own cache line; the data slots alternate between two
sets by generation parity, so one barrier per all-reduce is enough: a rank
writes generation g into set g % 2 only after it saw every flag reach g - 1,
and a peer raises g - 1 only after it finished reading generation g - 2, the
last one in that set. Stores are ordered data, then
flag, which x86's memory model keeps; another ISA would need fences (a C++
helper with std::atomic).

The expert dispatch's all-to-all and all-gather (uneven rows) go through the
same slots under the same barrier: each rank publishes its rows a slot's worth
at a time and every rank copies out the byte ranges meant for it.

The same segment carries rank 0's per-step control message to the other
ranks (`send` / `recv`: a ring of `ctrl_slots` payloads, each rank acknowledging
what it read, so rank 0 may run ahead of a later pipeline stage by that many
steps) and the logits gather. With pipeline parallelism the ranks are split
into tensor-parallel groups of `tp` (one per stage): each all-reduces and gathers
within its own group (`ShmGroup`'s ``group``), on its own ranks' flags and slots,
and the segment also holds the hand-offs between stages (engine.parallel.pipe).

Waiting spins for 10 µs, then yields the CPU, then sleeps in short naps, so
ranks that share cores with each other (or with other work) still progress;
with more ranks than cores it yields at once.
Every wait checks an abort flag any rank may raise, a deadline, and whether
the peer processes are alive: a dead or stuck rank never hangs the others.

Lifetime: rank 0 creates the file under /dev/shm, the other ranks map it,
and rank 0 unlinks it as soon as they have (`unlink`): from then on the
memory lives exactly as long as some rank maps it, whatever way the
processes end.
"""
from __future__ import annotations

import mmap
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.parallel.comm import CollectiveError, CollectiveStats

_LINE = 64
_PAGE = 4096
SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "kvrelay-tp-"


def _round(n: int, to: int) -> int:
    return -(-n // to) * to


def _row_bytes(x: torch.Tensor) -> int:
    n = x.element_size()
    for d in x.shape[1:]:
        n *= d
    return n


@dataclass(frozen=True)
class SegmentLayout:
    """Byte offsets of the segment's regions, the same on every rank."""

    size: int  # ranks
    ar_bytes: int  # one rank's all-reduce slot (larger tensors are reduced in chunks)
    gather_bytes: int  # one rank's logits slot (larger gathers go in row chunks)
    ctrl_bytes: int  # the control message's capacity
    # pipeline parallelism (engine.parallel.pipe): `pp` stages of `tp` ranks each (pp * tp == size)
    pp: int = 1
    ctrl_slots: int = 1  # control messages rank 0 may have out before every rank read the oldest
    act_bytes: int = 0  # one hand-off slot of a boundary (a batch's hidden states)
    ret_bytes: int = 0  # one return slot (a batch's logits rows, last stage -> rank 0)
    pipe_slots: int = 2  # slots per boundary and for the return: double-buffered
    counts_bytes: int = 0  # a mixture of experts: the stages' routed-token counters (engine.parallel.pipe)

    @property
    def tp(self) -> int:
        return self.size // self.pp

    # flag slots, in int64 units, each on its own line: [AR rank 0..n) [GATHER rank 0..n) ABORT CTRL_SEQ
    # (a TP group's first rank's GATHER flag: the gathers it has read, so the others may write again)
    # [CTRL_LEN slot 0..ctrl_slots) [CTRL_ACK rank 0..n) [ACT_SEQ boundary 0..pp-1)
    # [ACT_ACK boundary x tp rank) RET_SEQ RET_ACK [DONE stage 0..pp)
    @staticmethod
    def _line(i: int) -> int:
        return i * (_LINE // 8)

    def ar_flag(self, r: int) -> int:
        return self._line(r)

    def gather_flag(self, r: int) -> int:
        return self._line(self.size + r)

    @property
    def abort_flag(self) -> int:
        return self._line(2 * self.size)

    @property
    def ctrl_seq(self) -> int:
        return self._line(2 * self.size + 1)

    def ctrl_len(self, slot: int) -> int:
        return self._line(2 * self.size + 2 + slot)

    def ctrl_ack(self, r: int) -> int:
        return self._line(2 * self.size + 2 + self.ctrl_slots + r)

    def act_seq(self, boundary: int) -> int:
        return self._line(3 * self.size + 2 + self.ctrl_slots + boundary)

    def act_ack(self, boundary: int, tp_rank: int) -> int:
        return self._line(3 * self.size + 1 + self.ctrl_slots + self.pp + boundary * self.tp + tp_rank)

    @property
    def ret_seq(self) -> int:
        return self._line(3 * self.size + 1 + self.ctrl_slots + self.pp + (self.pp - 1) * self.tp)

    @property
    def ret_ack(self) -> int:
        return self.ret_seq + self._line(1)

    def stage_done(self, stage: int) -> int:
        return self.ret_seq + self._line(2 + stage)

    @property
    def flags_bytes(self) -> int:
        return _round(self.stage_done(self.pp) * 8, _PAGE)

    def ar_offset(self, parity: int, r: int) -> int:
        return self.flags_bytes + (parity * self.size + r) * self.ar_bytes

    def gather_offset(self, r: int) -> int:
        return self.flags_bytes + 2 * self.size * self.ar_bytes + r * self.gather_bytes

    def ctrl_offset(self, slot: int = 0) -> int:
        return self.gather_offset(self.size) + slot * self.ctrl_bytes

    def act_offset(self, boundary: int, slot: int) -> int:
        return self.ctrl_offset(self.ctrl_slots) + (boundary * self.pipe_slots + slot) * self.act_bytes

    def ret_offset(self, slot: int) -> int:
        return self.act_offset(self.pp - 1, 0) + slot * self.ret_bytes

    @property
    def counts_offset(self) -> int:
        return self.ret_offset(self.pipe_slots)

    @property
    def total_bytes(self) -> int:
        return _round(self.counts_offset + self.counts_bytes, _PAGE)

    @classmethod
    def make(cls, size: int, ar_bytes: int, gather_bytes: int, ctrl_bytes: int, pp: int = 1,
             act_bytes: int = 0, ret_bytes: int = 0, counts_bytes: int = 0) -> SegmentLayout:
        # rank 0 keeps up to pp batches in flight (engine.core); one more slot for a message between steps
        return cls(size, _round(ar_bytes, _PAGE), _round(gather_bytes, _PAGE), _round(ctrl_bytes, _PAGE),
                   pp=pp, ctrl_slots=1 if pp == 1 else pp + 1, act_bytes=_round(act_bytes, _PAGE),
                   ret_bytes=_round(ret_bytes, _PAGE), counts_bytes=counts_bytes)


def create_segment(layout: SegmentLayout) -> str:
    """A fresh, zeroed segment file for `layout`; returns its path (unlink it once every rank mapped it)."""
    path = os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, layout.total_bytes)
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return path


def unlink_segment(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class ShmGroup:
    """One rank's handle on the segment: `Collectives` (all_reduce, gather_vocab, all_to_all,
    all_gather) over its
    tensor-parallel ``group`` (the segment ranks of its pipeline stage; default: all), plus the
    control channel (rank 0 `send`s, the others `recv`). ``rank`` is the segment rank;
    ``self.rank`` / ``self.size`` then are the place in the group and its size, as a model sees them.

    ``peers_alive`` is called now and then while waiting (False: a peer process is gone);
    ``timeout_s`` bounds any collective wait (not `recv`, which waits for the next step)."""

    def __init__(self, path: str, layout: SegmentLayout, rank: int, timeout_s: float,
                 peers_alive: Callable[[], bool] | None = None, oversubscribed: bool = False,
                 group: range | None = None):
        self.group = list(group if group is not None else range(layout.size))
        self.seg_rank, self.layout = rank, layout
        self.rank, self.size = self.group.index(rank), len(self.group)
        self.timeout_s = timeout_s
        # (yield after, nap after) seconds of waiting. An all-reduce between ranks on two cores takes
        # ~5 µs, so a longer wait means the peer is off-CPU, often on this very core: yielding after
        # 10 µs rather than 100 µs cuts that case from ~240 to ~50 µs (BENCHMARKS.md). More ranks
        # than cores: give the core up at once.
        self._patience = (0.0, 2e-5) if oversubscribed else (1e-5, 1e-3)
        self._peers_alive = peers_alive or (lambda: True)
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, layout.total_bytes, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self._flags = memoryview(self._mm)[: layout.flags_bytes].cast("q")
        self._raw = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._others = [r for r in self.group if r != rank]  # segment ranks
        self._ar_gen = 0
        self._gather_gen = 0
        self._ctrl_seen = 0
        self._views: dict[tuple, list[torch.Tensor]] = {}
        self.stats = CollectiveStats()

    # ---- waiting --------------------------------------------------------
    def _aborted(self) -> CollectiveError:
        return CollectiveError(f"tensor-parallel group aborted (seen by rank {self.seg_rank})")

    def _wait(self, slot: int, target: int, what: str, idle: bool = False) -> None:
        f = self._flags
        if f[slot] >= target:
            return
        t0 = time.monotonic()
        spins = 0
        while f[slot] < target:
            spins += 1
            if spins & 255:
                continue
            if f[self.layout.abort_flag]:
                raise self._aborted()
            waited = time.monotonic() - t0
            yield_after, nap_after = self._patience
            if waited > (0.01 if idle else nap_after):
                time.sleep(1e-3 if idle else 5e-5)
            elif waited > yield_after:
                os.sched_yield()
            if spins & 4095 == 0:
                if not self._peers_alive():
                    raise CollectiveError(f"tensor-parallel {what}: a peer process of rank {self.seg_rank} is gone")
                if not idle and waited > self.timeout_s:
                    raise CollectiveError(f"tensor-parallel {what}: rank {self.seg_rank} waited {waited:.1f} s "
                                          f"(timeout {self.timeout_s:g} s) for a peer")

    def abort(self) -> None:
        """Make every rank's current and next wait raise."""
        self._flags[self.layout.abort_flag] = 1

    def wait_flag(self, slot: int, target: int, what: str) -> None:
        """Wait (bounded by ``timeout_s``, the abort flag and the peers' liveness) until flag
        ``slot`` reaches ``target``: the hand-offs of engine.parallel.pipe."""
        self._wait(slot, target, what)

    def wait_until(self, done: Callable[[], bool], what: str, timeout_s: float | None = None) -> None:
        """Wait, bounded as `wait_flag` (or by ``timeout_s``), until ``done()``: a CUDA transfer's
        completion (engine.parallel.pipe)."""
        t0 = time.monotonic()
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        polls = 0
        while not done():
            polls += 1
            if self._flags[self.layout.abort_flag]:
                raise self._aborted()
            time.sleep(2e-5)
            if polls & 63 == 0:
                if not self._peers_alive():
                    raise CollectiveError(f"tensor-parallel {what}: a peer process of rank {self.seg_rank} is gone")
                waited = time.monotonic() - t0
                if waited > timeout_s:
                    raise CollectiveError(f"tensor-parallel {what}: rank {self.seg_rank} waited {waited:.1f} s "
                                          f"(timeout {timeout_s:g} s) for a peer")

    def flag(self, slot: int) -> int:
        return self._flags[slot]

    def set_flag(self, slot: int, value: int) -> None:
        self._flags[slot] = value

    def region(self, offset: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A flat view of ``numel`` elements of the segment at ``offset``."""
        return self._raw[offset:][:numel * dtype.itemsize].view(dtype)

    # ---- collectives ----------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        flat = x.view(-1)  # x is contiguous
        nbytes = flat.numel() * x.element_size()
        if nbytes <= self.layout.ar_bytes:
            self._all_reduce_flat(flat)
        else:
            step = self.layout.ar_bytes // x.element_size()
            for a in range(0, flat.numel(), step):
                self._all_reduce_flat(flat[a:a + step])
        self.stats.add(nbytes, time.perf_counter() - t0)
        return x

    def _all_reduce_flat(self, flat: torch.Tensor) -> None:
        g = self._ar_gen = self._ar_gen + 1
        parity = g & 1
        lay = self.layout
        bufs = self._ar_slots(parity, flat.dtype, flat.numel())  # the group's, in its order
        bufs[self.rank].copy_(flat)
        f = self._flags
        f[lay.ar_flag(self.seg_rank)] = g
        for r in self._others:
            if f[lay.ar_flag(r)] < g:
                self._wait(lay.ar_flag(r), g, "all-reduce")
        # the same sum, in rank order, on every rank
        if flat.dtype == torch.float32:
            torch.add(bufs[0], bufs[1], out=flat)
            for b in bufs[2:]:
                flat.add_(b)
        else:
            acc = bufs[0].float()
            for b in bufs[1:]:
                acc.add_(b)
            flat.copy_(acc)

    def _ar_slots(self, parity: int, dtype: torch.dtype, numel: int) -> list[torch.Tensor]:
        key = ("ar", parity, dtype, numel)
        views = self._views.get(key)
        if views is None:
            nbytes = numel * dtype.itemsize
            views = [self._raw[self.layout.ar_offset(parity, r):][:nbytes].view(dtype) for r in self.group]
            if len(self._views) > 256:
                self._views.clear()
            self._views[key] = views
        return views

    def all_to_all(self, x: torch.Tensor, splits: list[list[int]]) -> torch.Tensor:
        t0 = time.perf_counter()
        row = _row_bytes(x)
        starts = [sum(splits[s][:self.rank]) * row for s in range(self.size)]  # my block in each source's rows
        wanted = [(a, a + splits[s][self.rank] * row) for s, a in enumerate(starts)]
        out = x.new_empty((sum(splits[s][self.rank] for s in range(self.size)), *x.shape[1:]))
        self._exchange(x, [sum(r) * row for r in splits], wanted, out, "all-to-all")
        self.stats.all_to_all_s += time.perf_counter() - t0
        return out

    def all_gather(self, x: torch.Tensor, rows: list[int]) -> torch.Tensor:
        t0 = time.perf_counter()
        row = _row_bytes(x)
        sizes = [n * row for n in rows]
        out = x.new_empty((sum(rows), *x.shape[1:]))
        self._exchange(x, sizes, [(0, n) for n in sizes], out, "all-gather")
        self.stats.all_to_all_s += time.perf_counter() - t0
        return out

    def _exchange(self, x: torch.Tensor, sizes: list[int], wanted: list[tuple[int, int]], out: torch.Tensor,
                  what: str) -> None:
        """Each rank r of the group publishes its ``sizes[r]`` bytes (x's); this rank copies bytes
        [lo, hi) = ``wanted[r]`` of each rank's into `out`, in rank order (its own straight from x).
        The bytes go through the all-reduce slots, ``ar_bytes`` of every rank's at a time: one
        round per window, the same rounds on every rank (they all know `sizes`), each one
        generation of the all-reduce's barrier (so the two share its slots safely)."""
        src = x.contiguous().view(-1).view(torch.uint8)
        dst = out.view(-1).view(torch.uint8)
        at, place = 0, []
        for lo, hi in wanted:
            place.append(at)
            at += hi - lo
        lo, hi = wanted[self.rank]
        dst[place[self.rank]: place[self.rank] + hi - lo].copy_(src[lo:hi])
        window = self.layout.ar_bytes
        lay, f = self.layout, self._flags
        for w0 in range(0, max(sizes), window):
            g = self._ar_gen = self._ar_gen + 1
            slots = self._ar_slots(g & 1, torch.uint8, window)
            mine = src[w0: min(w0 + window, sizes[self.rank])]
            slots[self.rank][: mine.numel()].copy_(mine)
            f[lay.ar_flag(self.seg_rank)] = g
            for j, r in enumerate(self.group):
                if r == self.seg_rank:
                    continue
                a, b = max(wanted[j][0], w0), min(wanted[j][1], w0 + window)
                if a >= b:
                    continue
                if f[lay.ar_flag(r)] < g:
                    self._wait(lay.ar_flag(r), g, what)
                at = place[j] + a - wanted[j][0]
                dst[at: at + b - a].copy_(slots[j][a - w0: b - w0])
            for r in self._others:  # every peer's flag too: the barrier the slot reuse relies on
                if f[lay.ar_flag(r)] < g:
                    self._wait(lay.ar_flag(r), g, what)

    def gather_vocab(self, x: torch.Tensor) -> torch.Tensor | None:
        # x: [N, vs] float32 -> [N, size * vs] on rank 0
        t0 = time.perf_counter()
        n, vs = x.shape
        rows = max(1, self.layout.gather_bytes // (vs * x.element_size()))
        out = torch.empty((n, self.size * vs), dtype=x.dtype) if self.rank == 0 else None
        for a in range(0, n, rows):
            self._gather_rows(x[a:a + rows], None if out is None else out[a:a + rows])
        self.stats.gather_s += time.perf_counter() - t0
        return out

    def _gather_rows(self, x: torch.Tensor, out: torch.Tensor | None) -> None:
        g = self._gather_gen = self._gather_gen + 1
        lay = self.layout
        n, vs = x.shape
        nbytes = x.numel() * x.element_size()
        ack = lay.gather_flag(self.group[0])  # the group's first rank raises its own flag once it read gather g
        if self.rank != 0:  # (to the group's first rank)
            if g > 1:  # its slot is free once the previous gather was read (several gathers may run back to back)
                self._wait(ack, g - 1, "logits gather (slot reuse)")
            self._raw[lay.gather_offset(self.seg_rank):][:nbytes].view(x.dtype).view(n, vs).copy_(x)
            self._flags[lay.gather_flag(self.seg_rank)] = g
            return
        out[:, :vs].copy_(x)
        for j, r in enumerate(self.group[1:], start=1):
            self._wait(lay.gather_flag(r), g, "logits gather")
            out[:, j * vs:(j + 1) * vs].copy_(self._raw[lay.gather_offset(r):][:nbytes].view(x.dtype).view(n, vs))
        self._flags[ack] = g

    # ---- control channel (rank 0 -> the others) --------------------------
    def send(self, payload: bytes) -> None:
        lay = self.layout
        if len(payload) > lay.ctrl_bytes:
            raise CollectiveError(f"tensor-parallel step message of {len(payload)} bytes exceeds the "
                                  f"channel's {lay.ctrl_bytes}")
        seq = self._ctrl_seen + 1
        slot = seq % lay.ctrl_slots
        if seq > lay.ctrl_slots:  # the slot's previous message: read by every rank
            for r in range(1, self.layout.size):
                self._wait(lay.ctrl_ack(r), seq - lay.ctrl_slots, "step channel")
        off = lay.ctrl_offset(slot)
        self._mm[off:off + len(payload)] = payload
        self._flags[lay.ctrl_len(slot)] = len(payload)
        self._ctrl_seen = seq
        self._flags[lay.ctrl_seq] = seq

    def recv(self) -> bytes:
        lay = self.layout
        self._ctrl_seen += 1
        self._wait(lay.ctrl_seq, self._ctrl_seen, "step message", idle=True)
        slot = self._ctrl_seen % lay.ctrl_slots
        off = lay.ctrl_offset(slot)
        payload = self._mm[off:off + self._flags[lay.ctrl_len(slot)]]  # (a copy)
        self._flags[lay.ctrl_ack(self.seg_rank)] = self._ctrl_seen
        return payload

    def close(self) -> None:
        """Drop this rank's views (the mapping goes with the last reference)."""
        self._views.clear()
