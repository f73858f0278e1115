"""Optional native kernels, compiled on first use and cached.

The one kernel so far is a skinny bf16 matmul for decode on CPUs with
AVX512-BF16 (see csrc/gemv_bf16.cpp). Where it cannot be built or the CPU
lacks the instructions, `linear` is plain `F.linear`; results agree to bf16
rounding either way.
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# Past this many rows (tokens) the matmul is compute-bound and oneDNN's GEMM wins.
MAX_SKINNY_ROWS = 32
_SRC = Path(__file__).parent / "csrc" / "gemv_bf16.cpp"
_lock = threading.Lock()
_ext = None
_tried = False


def cpu_has_avx512_bf16() -> bool:
    try:
        return "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def _build_dir() -> Path:
    from engine.weights import default_cache_dir

    d = default_cache_dir() / "kernels" / f"torch-{torch.__version__.replace('+', '_')}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def load_gemv():
    """The compiled extension, or None where it is unavailable (never raises)."""
    global _ext, _tried
    if _tried:
        return _ext
    with _lock:
        if _tried:
            return _ext
        _tried = True
        if not cpu_has_avx512_bf16():
            return None
        try:
            from torch.utils.cpp_extension import load

            _ext = load("kvrelay_gemv_bf16", [str(_SRC)], build_directory=str(_build_dir()),
                        extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"],
                        verbose=False)
        except Exception as e:  # no compiler, no ninja, ...: the torch path still works
            log.warning("bf16 decode kernel unavailable, using torch's matmul: %s", e)
            _ext = None
    return _ext


def make_linear(dtype: torch.dtype, device: torch.device, enable: bool = True):
    """`linear(x, w)` for a model: the skinny kernel for bf16 decode on CPU, else F.linear."""
    ext = load_gemv() if enable and dtype == torch.bfloat16 and device.type == "cpu" else None
    if ext is None:
        return F.linear
    gemv = ext.gemv_bf16

    def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # x: [T, K], w: [N, K] -> [T, N]
        if x.shape[0] <= MAX_SKINNY_ROWS and x.shape[1] % 32 == 0:
            return gemv(x, w)
        return F.linear(x, w)
    return linear


if __name__ == "__main__":  # `python -m engine.kernels`: build ahead of time (make install does)
    logging.basicConfig(level=logging.INFO)
    ok = load_gemv() is not None
    print("bf16 decode kernel:", "built" if ok else "not available on this machine")
    os._exit(0)
