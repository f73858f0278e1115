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

The same segment carries rank 0's per-step control message to the other
ranks (`send` / `recv`: a payload, its length, a sequence number) and the
logits gather.

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


@dataclass(frozen=True)
class SegmentLayout:
    """Byte offsets of the segment's regions, the same on every rank."""

    size: int  # ranks
    ar_bytes: int  # one rank's all-reduce slot (larger tensors are reduced in chunks)
    gather_bytes: int  # one rank's logits slot (larger gathers go in row chunks)
    ctrl_bytes: int  # the control message's capacity

    # flag slots, in int64 units: [AR rank 0..n) [GATHER rank 0..n) ABORT CTRL_SEQ CTRL_LEN
    def ar_flag(self, r: int) -> int:
        return r * (_LINE // 8)

    def gather_flag(self, r: int) -> int:
        return (self.size + r) * (_LINE // 8)

    @property
    def abort_flag(self) -> int:
        return 2 * self.size * (_LINE // 8)

    @property
    def ctrl_seq(self) -> int:
        return self.abort_flag + _LINE // 8

    @property
    def ctrl_len(self) -> int:
        return self.abort_flag + 2 * (_LINE // 8)

    @property
    def flags_bytes(self) -> int:
        return _round((2 * self.size + 3) * _LINE, _PAGE)

    def ar_offset(self, parity: int, r: int) -> int:
        return self.flags_bytes + (parity * self.size + r) * self.ar_bytes

    def gather_offset(self, r: int) -> int:
        return self.flags_bytes + 2 * self.size * self.ar_bytes + r * self.gather_bytes

    @property
    def ctrl_offset(self) -> int:
        return self.gather_offset(self.size)

    @property
    def total_bytes(self) -> int:
        return _round(self.ctrl_offset + self.ctrl_bytes, _PAGE)

    @classmethod
    def make(cls, size: int, ar_bytes: int, gather_bytes: int, ctrl_bytes: int) -> SegmentLayout:
        return cls(size, _round(ar_bytes, _PAGE), _round(gather_bytes, _PAGE), _round(ctrl_bytes, _PAGE))


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
    """One rank's handle on the segment: `Collectives` (all_reduce, gather_vocab) plus the
    control channel (rank 0 `send`s, the others `recv`).

    ``peers_alive`` is called now and then while waiting (False: a peer process is gone);
    ``timeout_s`` bounds any collective wait (not `recv`, which waits for the next step)."""

    def __init__(self, path: str, layout: SegmentLayout, rank: int, timeout_s: float,
                 peers_alive: Callable[[], bool] | None = None, oversubscribed: bool = False):
        self.rank, self.size, self.layout = rank, layout.size, layout
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
        self._others = [r for r in range(self.size) if r != rank]
        self._ar_gen = 0
        self._gather_gen = 0
        self._ctrl_seen = 0
        self._views: dict[tuple, list[torch.Tensor]] = {}
        self.stats = CollectiveStats()

    # ---- waiting --------------------------------------------------------
    def _aborted(self) -> CollectiveError:
        return CollectiveError(f"tensor-parallel group aborted (seen by rank {self.rank})")

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
                    raise CollectiveError(f"tensor-parallel {what}: a peer process of rank {self.rank} is gone")
                if not idle and waited > self.timeout_s:
                    raise CollectiveError(f"tensor-parallel {what}: rank {self.rank} waited {waited:.1f} s "
                                          f"(timeout {self.timeout_s:g} s) for a peer")

    def abort(self) -> None:
        """Make every rank's current and next wait raise."""
        self._flags[self.layout.abort_flag] = 1

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
        bufs = self._ar_slots(parity, flat.dtype, flat.numel())
        bufs[self.rank].copy_(flat)
        f = self._flags
        f[lay.ar_flag(self.rank)] = g
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
            views = [self._raw[self.layout.ar_offset(parity, r):][:nbytes].view(dtype) for r in range(self.size)]
            if len(self._views) > 256:
                self._views.clear()
            self._views[key] = views
        return views

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
        if self.rank != 0:
            self._raw[lay.gather_offset(self.rank):][:nbytes].view(x.dtype).view(n, vs).copy_(x)
            self._flags[lay.gather_flag(self.rank)] = g
            return
        out[:, :vs].copy_(x)
        for r in self._others:
            self._wait(lay.gather_flag(r), g, "logits gather")
            out[:, r * vs:(r + 1) * vs].copy_(self._raw[lay.gather_offset(r):][:nbytes].view(x.dtype).view(n, vs))

    # ---- control channel (rank 0 -> the others) --------------------------
    def send(self, payload: bytes) -> None:
        lay = self.layout
        if len(payload) > lay.ctrl_bytes:
            raise CollectiveError(f"tensor-parallel step message of {len(payload)} bytes exceeds the "
                                  f"channel's {lay.ctrl_bytes}")
        self._mm[lay.ctrl_offset:lay.ctrl_offset + len(payload)] = payload
        self._flags[lay.ctrl_len] = len(payload)
        self._ctrl_seen += 1
        self._flags[lay.ctrl_seq] = self._ctrl_seen

    def recv(self) -> bytes:
        lay = self.layout
        self._ctrl_seen += 1
        self._wait(lay.ctrl_seq, self._ctrl_seen, "step message", idle=True)
        n = self._flags[lay.ctrl_len]
        return self._mm[lay.ctrl_offset:lay.ctrl_offset + n]

    def close(self) -> None:
        """Drop this rank's views (the mapping goes with the last reference)."""
        self._views.clear()
