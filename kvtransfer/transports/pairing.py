"""Process groups for the `nccl` transport: one world-size-2 group per (sender, receiver) pair.

torch.distributed's default world is process-global, so we never call
``init_process_group``. Instead the receiver hosts one ``TCPStore`` and, for
each sender that completes the handshake, both sides construct a
``ProcessGroupGloo`` (CPU tensors) or ``ProcessGroupNCCL`` (CUDA tensors)
directly on a ``PrefixStore(pair_id, store)`` with world size 2: receiver
rank 0, sender rank 1. Groups of different pairs are independent objects, so
one process can hold many, and any thread may post send/recv on them.
"""
from __future__ import annotations

import datetime
import threading

import torch
import torch.distributed as dist

RECEIVER_RANK, SENDER_RANK = 0, 1
# A chunk of several layers travels as one message a layer (tags tag, tag + 1, ...) where a layer's part is
# at least this big, else as one message, copied together: a short prompt's chunk of many thin layers (16
# tokens: 30 layers of 8 KiB) would pay a message per layer to save copying almost nothing. 512 KiB parts (two
# ranks' units at 1024 tokens) sent as views measured no slower than copied (BENCHMARKS.md).
MIN_PART_BYTES = 256 << 10


def num_parts(nbytes: int, num_layers: int) -> int:
    """How many messages a chunk of ``nbytes`` over ``num_layers`` layers travels as (both sides agree)."""
    num_layers = max(1, num_layers)
    return num_layers if nbytes // num_layers >= MIN_PART_BYTES else 1


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def host_store(host: str, timeout_s: float) -> dist.TCPStore:
    """The receiver's rendezvous store on a free port (``store.port``)."""
    return dist.TCPStore(host, 0, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def join_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=timeout_s))


def make_group(store: dist.Store, pair_id: str, rank: int, backend: str, host: str, timeout_s: float):
    """Blocks until both ranks of the pair have joined (or timeout_s)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore(f"kvt/{pair_id}", store)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(prefixed, rank, 2, opts)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
    raise ValueError(f"unknown process-group backend {backend!r}")


class PairGroup:
    """A pair's process group, possibly still being built on a background thread."""

    def __init__(self, backend: str):
        self.backend = backend
        self.group = None
        self.error: str | None = None
        self.is_broken = False
        self._ready = threading.Event()

    def build_async(self, store, pair_id: str, rank: int, host: str, timeout_s: float) -> None:
        def run():
            try:
                self.group = make_group(store, pair_id, rank, self.backend, host, timeout_s)
            except Exception as e:  # the peer never joined
                self.error = f"process group for pair {pair_id} failed: {e}"
                self.is_broken = True
            self._ready.set()

        threading.Thread(target=run, name=f"kvt-pair-{pair_id[:8]}", daemon=True).start()

    def wait_ready(self, timeout_s: float):
        if not self._ready.wait(timeout_s):
            raise TimeoutError("process group not ready")
        if self.group is None:
            raise RuntimeError(self.error or "process group failed")
        return self.group

    def send(self, tensor: torch.Tensor, tag: int, dst: int):
        return self.group.send([tensor], dst, tag)

    def recv(self, tensor: torch.Tensor, tag: int, src: int):
        return self.group.recv([tensor], src, tag)


class StagingBuffers:
    """Reusable receive buffers by size: a fresh large CPU buffer costs page faults on every chunk."""

    def __init__(self, device: torch.device, max_cached_bytes: int = 256 << 20):
        self.device = device
        self.max_cached_bytes = max_cached_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self._cached_bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            stack = self._free.get(nbytes)
            if stack:
                self._cached_bytes -= nbytes
                return stack.pop()
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            if self._cached_bytes + buf.numel() <= self.max_cached_bytes:
                self._free.setdefault(buf.numel(), []).append(buf)
                self._cached_bytes += buf.numel()
