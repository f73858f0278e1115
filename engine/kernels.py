"""The small ops the model is made of, in two implementations.

`TorchOps` is plain torch and is the reference (fp32 runs, GPUs, any CPU).
`NativeOps` is for bf16 on CPUs with AVX512-BF16: C++ kernels compiled on
first use and cached (csrc/): a matmul on pre-packed weights (`PackedWeight`)
for every batch size, decode and prefill, residual add +
RMSNorm, SiLU-and-multiply, rotary embedding in place, decode attention read
straight from the paged cache, and `FusedDecoder`, which runs the whole layer
stack for a batch of decode tokens in one call. Decode on a CPU is bound by
per-op overhead as much as by memory, so fusing these is what makes it fast.
Both agree to bf16 rounding (tests/engine/test_kernels.py).
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# Decode batches up to this many tokens run through FusedDecoder.
MAX_FUSED_ROWS = 256
_CSRC = Path(__file__).parent / "csrc"
_SRCS = [_CSRC / n for n in ("matmul_bf16.cpp", "cpu_ops.cpp", "decode_step.cpp")]
_lock = threading.Lock()
_ext = None
_tried = False


def cpu_flags() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_has_avx512_bf16() -> bool:
    return "avx512_bf16" in cpu_flags()


def cpu_runs_bf16_fast() -> bool:
    """AVX512-BF16 or AMX: where bf16 beats fp32 on this CPU (measured)."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _build_dir() -> Path:
    """One folder per (torch version, kernel sources): checkouts with other
    sources (another version, a work tree) never rebuild over each other."""
    import hashlib

    from engine.weights import default_cache_dir

    h = hashlib.sha256()
    for p in sorted(_CSRC.iterdir()):
        if p.suffix in (".cpp", ".h"):
            h.update(p.name.encode() + b"\0" + p.read_bytes())
    d = default_cache_dir() / "kernels" / f"torch-{torch.__version__.replace('+', '_')}-{h.hexdigest()[:12]}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def load_native_ops():
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

            _ext = load("kvrelay_cpu_ops", [str(p) for p in _SRCS], build_directory=str(_build_dir()),
                        extra_include_paths=[str(_CSRC)],
                        extra_cflags=["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"],
                        verbose=False)
        except Exception as e:  # no compiler, no ninja, ...: the torch path still works
            log.warning("bf16 decode kernel unavailable, using torch's matmul: %s", e)
            _ext = None
    return _ext


class PackedWeight:
    """A bf16 matmul weight W [n, k] in the layout the native matmul streams
    (engine/csrc/matmul_bf16.cpp): blocks of 32 output rows of W with pairs of
    k interleaved, ``data[b, k // 2, c, k % 2] = W[32 * b + c, k]``, shape
    [ceil(n / 32), k / 2, 32, 2], the padding rows of the last block zero.
    The same bytes as W (plus the padding), so a model holds its weights once
    in this layout, not twice; rows of W (an embedding lookup through tied
    weights) are read back with `rows`."""

    COLS = 32
    __slots__ = ("data", "n", "k")

    def __init__(self, data: torch.Tensor, n: int, k: int):
        self.data, self.n, self.k = data, n, k

    @classmethod
    def pack(cls, w: torch.Tensor) -> PackedWeight:
        n, k = w.shape
        if k % 2:
            raise ValueError(f"PackedWeight: k = {k} must be even")
        blocks = -(-n // cls.COLS)
        w = F.pad(w, (0, 0, 0, blocks * cls.COLS - n))
        return cls(w.reshape(blocks, cls.COLS, k // 2, 2).transpose(1, 2).contiguous(), n, k)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def unpack(self) -> torch.Tensor:
        """W [n, k] (a copy)."""
        return self.data.transpose(1, 2).reshape(-1, self.k)[: self.n]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """W[ids] [len(ids), k]: F.embedding(ids, W) without W in row layout
        (torch's indexing; NativeOps.embedding is the fast one)."""
        return self.data[ids // self.COLS, :, ids % self.COLS].reshape(ids.shape[0], self.k)


class TorchOps:
    """Reference implementations (any dtype, any device)."""

    linear = staticmethod(F.linear)
    packs_weights = False  # matmul weights stay plain [N, K] tensors

    @staticmethod
    def logits(hidden, lm_head):  # [N, H] -> [N, vocab] float32
        return F.linear(hidden, lm_head).float()

    @staticmethod
    def embedding(ids, w):
        return F.embedding(ids, w)

    @staticmethod
    def fused_decoder(model):
        return None

    @staticmethod
    def rms_norm(x, w, eps):
        return F.rms_norm(x, (x.shape[-1],), w, eps)

    @staticmethod
    def add_rms_norm(x, delta, w, eps):
        # x: [T, H] -> (x + delta, rms_norm(x + delta) * w)
        x = x + delta
        return x, F.rms_norm(x, (x.shape[-1],), w, eps)

    @staticmethod
    def silu_mul(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def rope(rotary, positions):
        cos = rotary.cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = rotary.sin[positions].unsqueeze(1)
        return lambda qk: rotary(qk, cos, sin)

    decode_attention = None  # attention.py's torch path


class NativeOps(TorchOps):
    """bf16 on CPU through the compiled kernels."""

    def __init__(self, ext):
        self.ext = ext

    packs_weights = True  # the model holds its matmul weights as PackedWeight

    def linear(self, x, w):
        # x: [T, K], w: PackedWeight [N, K] (or a plain [N, K] tensor) -> [T, N]
        if isinstance(w, PackedWeight):
            return self.ext.linear_packed(x, w.data, w.n)
        return F.linear(x, w)

    def logits(self, hidden, lm_head):
        if isinstance(lm_head, PackedWeight):
            return self.ext.linear_packed(hidden, lm_head.data, lm_head.n, f32_out=True)
        return F.linear(hidden, lm_head).float()

    def embedding(self, ids, w):
        # ids: [T] -> rows of w [T, K]; w: PackedWeight (a tied LM head) or a plain tensor
        if isinstance(w, PackedWeight):
            return self.ext.packed_rows(w.data, ids, w.n, w.k)
        return F.embedding(ids, w)

    def fused_decoder(self, model):
        """A FusedDecoder over `model`'s weights (engine.model.LlamaModel), or
        None where its matmul weights are not packed."""
        if not all(isinstance(w, PackedWeight) for L in model.layers for w in (L.qkv_w, L.o_w, L.gate_up_w,
                                                                                L.down_w)):
            return None
        empty = torch.empty(0, dtype=torch.bfloat16)
        layers = [[L.in_norm, L.post_norm, L.qkv_w.data, _or(L.qkv_b, empty), L.o_w.data, L.gate_up_w.data,
                   L.down_w.data, _or(L.q_norm, empty), _or(L.k_norm, empty)] for L in model.layers]
        cfg = model.cfg
        return self.ext.FusedDecoder(layers, model.norm, model.rotary.cos, model.rotary.sin, cfg.num_heads,
                                     cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, model.scale)

    # The elementwise kernels run for every batch, so a decode batch computes the
    # same numbers through the per-op path as through FusedDecoder, and for
    # prefill-sized ones they beat torch's ops (2048 x 576 tokens, side by side:
    # add + RMSNorm 0.95 -> 0.35 ms, SiLU-and-multiply 2.0 -> 1.0, rotary 0.8 -> 0.2).
    def rms_norm(self, x, w, eps):
        return self.ext.add_rms_norm(x.contiguous(), None, w, eps)

    def add_rms_norm(self, x, delta, w, eps):
        return x, self.ext.add_rms_norm(x, delta.contiguous(), w, eps)  # x updated in place

    def silu_mul(self, gate_up):
        return self.ext.silu_mul(gate_up.contiguous())

    def rope(self, rotary, positions):
        rope_ = self.ext.rope_

        def apply(qk):
            rope_(qk, rotary.cos, rotary.sin, positions)
            return qk
        return apply

    def decode_attention(self, q, kv_cache, meta, scale):
        return self.ext.paged_decode_attention(q.contiguous(), kv_cache, meta.decode_block_tables,
                                               meta.decode_context_lens, scale)


def _or(t, default):
    return default if t is None else t


def make_ops(dtype: torch.dtype, device: torch.device, enable: bool = True):
    """NativeOps for bf16 on a CPU that can run them, else TorchOps."""
    ext = load_native_ops() if enable and dtype == torch.bfloat16 and device.type == "cpu" else None
    return NativeOps(ext) if ext is not None else TorchOps()


if __name__ == "__main__":  # `python -m engine.kernels`: build ahead of time (make install does)
    logging.basicConfig(level=logging.INFO)
    ok = load_native_ops() is not None
    print("bf16 CPU kernels:", "built" if ok else "not available on this machine")
    os._exit(0)
