"""The small ops the model is made of, in two implementations.

`TorchOps` is plain torch and is the reference (fp32 runs, GPUs, any CPU).
`NativeOps` is for bf16 on CPUs: C++ kernels compiled on first use and cached
(csrc/): a matmul on pre-packed weights (`PackedWeight`) for every batch
size, decode and prefill, residual add + RMSNorm, SiLU-and-multiply, rotary
embedding in place, decode attention read straight from the paged cache, and
`FusedDecoder`, which runs the whole layer stack for a batch of decode tokens
in one call. Decode on a CPU is bound by per-op overhead as much as by
memory, so fusing these is what makes it fast.

The same sources are built once per instruction set (`ISAS`, csrc/isa.h),
each as its own extension module compiled for its own target: AVX512-BF16
(vdpbf16ps), AVX-512 without BF16 (Intel's Cascade Lake and Ice Lake: bf16
weights widened to fp32 in zmm registers, fp32 math) and AVX2 + FMA (the same
in ymm registers). The best one the CPU runs is used unless a caller names one
(`make_ops(..., isa=...)`, `LLM(kernel_isa=...)`). All agree with the torch
reference to bf16 rounding, and each is batch invariant on its own
(tests/engine/test_kernels.py); avx512bf16 differs from the other two in the
last bits (vdpbf16ps adds a k-pair's two products before accumulating), while
avx512 and avx2 sum each matmul output in the same order: the same matmul bits
(their norms and attention reduce over 16 lanes against 8, so a whole model
may still differ in the last bits).

`QuantOps` runs a model whose matmul weights stay quantized (engine/quant.py,
`EngineConfig.quantization`) on the same builds: fp32 activations, the
weights' codes widened in registers (csrc/matmul_quant.cpp), the fp32 build
of the elementwise kernels, and `QuantFusedDecoder` for decode batches.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# Decode batches up to this many tokens run through FusedDecoder.
MAX_FUSED_ROWS = 256
_CSRC = Path(__file__).parent / "csrc"
_SRCS = [_CSRC / n for n in ("matmul_bf16.cpp", "matmul_quant.cpp", "cpu_ops.cpp", "decode_step.cpp")]


@dataclass(frozen=True)
class Isa:
    """One build of the kernels: the /proc/cpuinfo flags a CPU needs to run it
    and the compiler flags it is built with (csrc/isa.h picks the code by them)."""

    name: str
    cpu_flags: tuple[str, ...]
    cflags: tuple[str, ...]


# Best first: make_ops picks the first the CPU runs.
ISAS = (
    Isa("avx512bf16", ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"),
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni")),
    Isa("avx512", ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")),
    Isa("avx2", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),
)
ISA_NAMES = tuple(i.name for i in ISAS)
# What a caller may ask for: the best the CPU runs, one by name, or torch's ops
# (the same as engine.config.KERNEL_ISAS, which EngineConfig validates against).
KERNEL_ISAS = ("auto",) + ISA_NAMES + ("none",)
_lock = threading.Lock()
_exts: dict[str, object] = {}  # isa name -> the loaded module, or None where it failed to build


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo's first `flags` line); empty where unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_isas() -> list[str]:
    """The kernel ISAs this CPU can run, best first."""
    flags = cpu_flags()
    return [i.name for i in ISAS if flags.issuperset(i.cpu_flags)]


def cpu_runs_bf16_fast() -> bool:
    """Where bf16 beats fp32 on this CPU (`dtype: auto`, engine.core.pick_dtype):
    wherever a native kernel build runs, AVX2 + FMA included, or AMX, where
    torch's own bf16 matmuls are fast. On AVX2 the weights stay bf16 and the
    math is fp32, so decode reads half the bytes of fp32 and runs fused:
    measured side by side (BENCHMARKS.md "Engine on AVX2"), SmolLM2 decode
    steps of 1 and 16 tokens took 9.6 and 65.5 ms of CPU on the avx2 path
    against 59.5 and 179.3 ms in fp32 through torch's ops."""
    return load_native_ops() is not None or "amx_bf16" in cpu_flags()


def _build_dir(isa: str) -> Path:
    """One folder per (torch installation, kernel sources, ISA): checkouts with other
    sources (another version, a work tree) never rebuild over each other, and nor do two
    environments with the same sources: build.ninja names the torch headers' folder, so
    two virtualenvs sharing a folder would each rebuild the other's build on every load."""
    import hashlib

    from engine.weights import default_cache_dir

    h = hashlib.sha256(str(Path(torch.__file__).resolve().parent).encode() + b"\0")
    for p in sorted(_CSRC.iterdir()):
        if p.suffix in (".cpp", ".h"):
            h.update(p.name.encode() + b"\0" + p.read_bytes())
    d = (default_cache_dir() / "kernels" / f"torch-{torch.__version__.replace('+', '_')}-{h.hexdigest()[:12]}"
         / isa)
    d.mkdir(parents=True, exist_ok=True)
    return d


def load_native_ops(isa: str | None = None):
    """The compiled extension for `isa` (None: the best this CPU runs), or None
    where it is unavailable: the CPU lacks the ISA, or it did not build (never raises)."""
    names = cpu_isas()
    if isa is None:
        return next((ext for ext in map(load_native_ops, names) if ext is not None), None)
    if isa not in names:
        return None
    with _lock:
        if isa not in _exts:
            _exts[isa] = _build(_isa(isa))
    return _exts[isa]


def _build(isa: Isa):
    """Build (or load the cached build of) `isa`'s extension.

    The sources are copied into the build folder and compiled from there, so every checkout
    with the same sources writes the same build.ninja and shares one build (torch rebuilds
    whenever build.ninja changes, and absolute source paths differ per checkout). The build
    runs under an flock of our own, which the kernel releases if the process dies: holding
    it, a torch lock file left by a killed build is stale, and is removed instead of being
    waited on for ever."""
    import fcntl
    import shutil

    try:
        from torch.utils.cpp_extension import load

        d = _build_dir(isa.name)
        src = d / "src"
        src.mkdir(exist_ok=True)
        with open(d / ".kvrelay-build.lock", "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            for p in _CSRC.iterdir():
                if p.suffix in (".cpp", ".h") and (not (src / p.name).exists()
                                                   or (src / p.name).read_bytes() != p.read_bytes()):
                    shutil.copyfile(p, src / p.name)
            stale = d / "lock"  # torch.utils.file_baton's: nobody else can hold it while we hold the flock
            if stale.exists():
                log.warning("removing a stale kernel build lock %s (a build was killed)", stale)
                stale.unlink()
            return load(f"kvrelay_cpu_ops_{isa.name}", [str(src / p.name) for p in _SRCS], build_directory=str(d),
                        extra_include_paths=[str(src)],
                        extra_cflags=["-O3", "-fopenmp", "-fvisibility=hidden", *isa.cflags], verbose=False)
    except Exception as e:  # no compiler, no ninja, ...: the torch path still works
        log.warning("%s CPU kernels unavailable, using torch's ops: %s", isa.name, e)
        return None


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
    quantizes_weights = False  # (QuantOps: they are engine.quant.QuantWeight)

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
    """bf16 on CPU through the compiled kernels of one ISA (`isa`)."""

    def __init__(self, ext):
        self.ext = ext
        self.isa: str = ext.isa

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
        # (no final norm on a pipeline stage before the last: it returns the residual stream)
        return self.ext.FusedDecoder(layers, _or(model.norm, empty), model.rotary.cos, model.rotary.sin, cfg.num_heads,
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


class QuantOps(NativeOps):
    """fp32 activations on quantized matmul weights (engine.quant.QuantWeight,
    EngineConfig.quantization) through the compiled kernels of one ISA: each
    matmul reads the weights as they are stored and dequantizes them in
    registers (csrc/matmul_quant.cpp); the elementwise kernels are NativeOps'
    in their fp32 build; tied embeddings are rows of the quantized LM head."""

    packs_weights = False  # the model quantizes its matmul weights instead (LlamaModel.select_kernels)
    quantizes_weights = True

    def linear(self, x, w):
        # x: [T, K] fp32, w: QuantWeight [N, K] (or a plain tensor) -> [T, N] fp32
        from engine.quant import QuantWeight

        if isinstance(w, QuantWeight):
            return self.ext.linear_quant(x, w.q, w.scales, w.mins, w.n, w.bits, scale_d=w.scale_d, min_d=w.min_d,
                                         grid=w.grid)
        return F.linear(x, w)

    def logits(self, hidden, lm_head):
        return self.linear(hidden, lm_head).float()

    def embedding(self, ids, w):
        from engine.quant import QuantWeight

        if isinstance(w, QuantWeight):
            return self.ext.quant_rows(w.q, w.scales, w.mins, ids, w.n, w.bits, w.scale_d, w.min_d, w.grid)  # = w.rows(ids)
        return F.embedding(ids, w)

    def fused_decoder(self, model):
        """A QuantFusedDecoder over `model`'s weights, or None where a matmul weight is not quantized."""
        from engine.quant import QuantWeight

        mats = ("qkv_w", "o_w", "gate_up_w", "down_w")
        if not all(isinstance(getattr(L, n), QuantWeight) for L in model.layers for n in mats):
            return None
        empty = torch.empty(0)
        layers = [[L.in_norm, L.post_norm, _or(L.qkv_b, empty), _or(L.q_norm, empty), _or(L.k_norm, empty)]
                  + [t for n in mats for t in getattr(L, n).tensors()] for L in model.layers]
        bits = [[getattr(L, n).bits for n in mats] for L in model.layers]
        cfg = model.cfg
        return self.ext.QuantFusedDecoder(layers, bits, model.norm, model.rotary.cos, model.rotary.sin,
                                          cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                          model.layers[0].down_w.k, cfg.rms_norm_eps, model.scale)


def _or(t, default):
    return default if t is None else t


def make_ops(dtype: torch.dtype, device: torch.device, enable: bool = True, isa: str = "auto"):
    """NativeOps for bf16 on a CPU that can run them, else TorchOps.

    isa: one of KERNEL_ISAS. "auto": the best this CPU runs; a name: that build,
    or a ValueError where this CPU cannot run it or it did not build (so a test
    or a benchmark that asks for a path never measures another); "none": torch's ops.
    """
    if isa not in KERNEL_ISAS:
        raise ValueError(f"kernel_isa: must be one of {KERNEL_ISAS}, got {isa!r}")
    if not enable or isa == "none" or dtype != torch.bfloat16 or device.type != "cpu":
        return TorchOps()
    if isa == "auto":
        ext = load_native_ops()
        return NativeOps(ext) if ext is not None else TorchOps()
    ext = load_native_ops(isa)
    if ext is None:
        why = "did not build (see the log)" if isa in cpu_isas() else f"needs CPU flags {_isa(isa).cpu_flags}"
        raise ValueError(f"kernel_isa: {isa!r} is not available on this machine: it {why}")
    return NativeOps(ext)


def make_quant_ops(device: torch.device, isa: str = "auto") -> QuantOps:
    """QuantOps on the kernels of `isa` (one of KERNEL_ISAS but "none"); a ValueError
    where the device is not a CPU or no native path runs here: quantized weights
    are only ever computed on by the native kernels."""
    if isa not in KERNEL_ISAS:
        raise ValueError(f"kernel_isa: must be one of {KERNEL_ISAS}, got {isa!r}")
    if device.type != "cpu":
        raise ValueError(f"quantization: runs on CPU only (device {str(device)!r})")
    if isa == "none":
        raise ValueError("quantization: needs a native CPU kernel path; kernel_isa 'none' runs torch's ops")
    ext = load_native_ops(None if isa == "auto" else isa)
    if ext is None:
        if isa == "auto":
            raise ValueError("quantization: needs a native CPU kernel path (AVX2 + FMA or AVX-512 BF16); "
                             f"this CPU runs {', '.join(cpu_isas()) or 'none'} and none built (see the log)")
        why = "did not build (see the log)" if isa in cpu_isas() else f"needs CPU flags {_isa(isa).cpu_flags}"
        raise ValueError(f"kernel_isa: {isa!r} is not available on this machine: it {why}")
    return QuantOps(ext)


def _isa(name: str) -> Isa:
    return next(i for i in ISAS if i.name == name)


if __name__ == "__main__":  # `python -m engine.kernels`: build ahead of time (make install does)
    logging.basicConfig(level=logging.INFO)
    runs = cpu_isas()
    built = [name for name in runs if load_native_ops(name) is not None]
    print("CPU kernel ISA paths built:", ", ".join(built) or "none",
          f"(this CPU runs: {', '.join(runs) or 'none of ' + ', '.join(ISA_NAMES)})")
    os._exit(0)
