"""Keep freed multi-MB buffers in the process heap instead of unmapping them (glibc only).

grpcio allocates fresh buffers for every message it sends or receives (its
slices, and the Python bytes handed to the deserializer); the sender joins
each chunk into a new bytes object. By default glibc serves such allocations
with mmap and returns them with munmap on free, so every multi-MB chunk pays
its page faults and page zeroing again, on both sides. Raising the mmap and
trim thresholds lets glibc reuse that memory (BENCHMARKS.md, "Measured
design choices").

The setting is process-wide and only affects allocations up to
``MMAP_THRESHOLD_BYTES``; the process may keep up to ``TRIM_THRESHOLD_BYTES``
of freed memory mapped (its RSS stays higher by that much at most).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import threading

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's maximum on 64-bit
TRIM_THRESHOLD_BYTES = 256 << 20

_lock = threading.Lock()
_is_set: bool | None = None


def keep_large_buffers() -> bool:
    """Apply the thresholds once per process; False where the C library has no mallopt (not glibc)."""
    global _is_set
    with _lock:
        if _is_set is None:
            _is_set = _mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and _mallopt(M_TRIM_THRESHOLD,
                                                                                    TRIM_THRESHOLD_BYTES)
        return _is_set


def _mallopt(param: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(param, value) == 1
