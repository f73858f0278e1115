"""Quantized matmul weights, kept quantized (EngineConfig.quantization).

- ``int8``: per-output-row symmetric int8 made at load from any checkpoint
  (`quantize_int8`): code = round(w / s), s = max |w[row]| / 127, fp32 scales.
- ``gguf``: a GGUF file's own block formats, read as stored (`read_gguf_rows`):
  Q8_0 (32 signed bytes and an fp16 scale per block of 32), Q4_1 (32 nibbles,
  an fp16 scale and minimum: 5 bits a weight read) and Q4_0 (nibbles - 8, held as signed
  nibbles, the minimum -8 x scale implied: 4.5 bits); Q5_0, Q5_1 and Q5_K (5-bit codes,
  held as bytes unless KVRELAY_GGUF_FIVE_BIT=keep, see `FIVE_BIT_ENV`); and the k-quants' super-blocks of 256,
  whose sub-block scales stay 6- or 8-bit codes beside the super-block's fp32 factors,
  multiplied in the kernel as gguf dequantizes them (`QuantRows.scale_d`): Q4_K (nibbles,
  a scale and minimum code per 32: 4.75 bits a weight read), Q6_K (6-bit codes - 32 held
  as signed bytes, a scale code per 16: 8.6 bits), Q3_K (3-bit codes - 4 as signed nibbles, a
  6-bit scale code per 16: 4.6 bits, against 3.4 stored) and Q2_K (2-bit codes as nibbles, a
  4-bit scale and minimum code per 16: 5.25 bits, against 2.6 stored); and the i-quants IQ4_NL
  and IQ4_XS, their 4-bit indices kept as nibbles and looked up in registers (`QuantRows.grid`:
  IQ4_NL with an fp16 scale per 32, 4.5 bits; IQ4_XS with its 6-bit scale codes per 32 under an
  fp32 factor per 256, 4.4 bits).

A weight is read in row form (`QuantRows`: codes one per byte, so rows can be
concatenated, permuted and checked like a tensor), then packed once into the
layout the native kernel streams (`QuantWeight`, engine/csrc/quant.h), where
the codes of consecutive k of one row share a 32-bit word. The model computes
with fp32 activations; every matmul is that of the dequantized weights
(`QuantWeight.dequantize`), up to summation order.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from engine.config import ConfigError

log = logging.getLogger(__name__)

# How 5-bit GGUF codes (Q5_0, Q5_1, Q5_K) are held: "widen" (default) to bytes, Q5_0 as signed bytes
# like Q8_0 (8.5 bits read per weight, not 6.0); "keep" at 5 bits (a nibble plane and a word of
# fifth bits per 32 k). Measured side by side on the default model in llama.cpp's Q4_K_M layout
# (BENCHMARKS.md): on a Zen 4 the 5-bit tile's extra shifts cost more than the 16% fewer bytes save
# (single stream 0.88x / 0.83x of the bytes form on avx512bf16 / avx2 at 1 thread, 0.98x / 0.91x at
# 2); "keep" is for machines with less bandwidth per core, where a step is bound by bytes.
FIVE_BIT_ENV = "KVRELAY_GGUF_FIVE_BIT"
FIVE_BIT_FORMS = ("widen", "keep")

QUANTIZATIONS = ("none", "int8", "gguf")
BLOCK = 32  # output rows per packed block (engine/csrc/isa.h kPackedCols); also a GGUF block's k
# GGUF block type -> (weights per block, bytes per block, code bits as held)
GGUF_FORMATS = {"Q8_0": (32, 34, 8), "Q4_0": (32, 18, 4), "Q4_1": (32, 20, 4), "Q5_0": (32, 22, 5),
                "Q5_1": (32, 24, 5), "Q2_K": (256, 84, 4), "Q3_K": (256, 110, 4), "Q4_K": (256, 144, 4),
                "Q5_K": (256, 176, 5), "Q6_K": (256, 210, 8), "IQ4_NL": (32, 18, 4), "IQ4_XS": (256, 136, 4)}
# IQ4_NL and IQ4_XS: a 4-bit index per weight into these values (llama.cpp's non-linear grid)
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
IQ4_GRID = torch.from_numpy(IQ4_VALUES)


class QuantError(ValueError):
    """A weight cannot be held in the asked-for quantized format; the message names it."""


@dataclass
class QuantRows:
    """A quantized [n, k] weight by rows. codes: [n, k], int8 signed bytes
    (bits 8 without mins) or nibbles (bits 4 without mins, -8..7), or unsigned codes as int8 or
    uint8 (0..15 for bits 4, 0..31 for bits 5, and 8-bit codes with mins); scales: [n, k // group] fp16 (GGUF) or fp32;
    mins: the same, or None. W = codes * scales (+ mins), per group of `group`
    consecutive k.

    Coded scales (the k-quants as stored): scales and mins are int8 codes, and scale_d and
    min_d [n, k // sup] fp32 their factors per `sup` k, the value of a scale being
    scale_d * code in fp32 (one rounding: gguf's own product), of a minimum min_d * code.

    A grid (IQ4_NL, IQ4_XS): int8 [16] values that the codes, 4-bit indices (bits 4, no mins),
    stand for: W = grid[codes] * scales."""

    fmt: str  # "q8_0", "q4_1" or "int8"
    bits: int
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None
    scale_d: torch.Tensor | None = None
    min_d: torch.Tensor | None = None
    grid: torch.Tensor | None = None

    def valued(self) -> QuantRows:
        """The same weight with gridded codes replaced by the signed bytes they stand for."""
        if self.grid is None:
            return self
        return QuantRows(self.fmt, 8, self.grid[self.codes.long()], self.scales, None, self.scale_d, self.min_d)

    @property
    def coded(self) -> bool:
        return self.scale_d is not None

    @property
    def sup(self) -> int:
        """k per factor of coded scales (a k-quant's 256), 0 for plain ones."""
        return self.codes.shape[1] // self.scale_d.shape[1] if self.coded else 0

    def decoded(self) -> QuantRows:
        """The same weight with its scales and minimums as fp32 values (coded ones multiplied out)."""
        if not self.coded:
            return self
        r = self.sup // self.group

        def values(codes, d):
            return None if codes is None else d.repeat_interleave(r, dim=1) * codes.float()
        return QuantRows(self.fmt, self.bits, self.codes, values(self.scales, self.scale_d),
                         values(self.mins, self.min_d), grid=self.grid)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def group(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]

    def map_rows(self, fn) -> QuantRows:
        """The same weight with `fn` (a row permutation, a slice) applied to every part's rows."""
        def f(t):
            return None if t is None else fn(t)
        return QuantRows(self.fmt, self.bits, fn(self.codes), fn(self.scales), f(self.mins), f(self.scale_d),
                         f(self.min_d), self.grid)

    def dequantize(self) -> torch.Tensor:  # [n, k] float32
        if self.coded or self.grid is not None:
            return self.valued().decoded().dequantize()
        d = self.scales.float().repeat_interleave(self.group, dim=1)
        if self.mins is None:
            return self.codes.float() * d
        return torch.addcmul(self.mins.float().repeat_interleave(self.group, dim=1), self.codes.float(), d)

    @property
    def form(self) -> tuple:
        """What the kernel needs to know of a weight: code bits, block of k per scale, the scales'
        dtype (int8: codes), whether the codes are signed bytes (8-bit, no minimums), and k per
        factor of coded scales, and the grid its codes index."""
        grid = () if self.grid is None else (tuple(self.grid.tolist()),)
        return (self.bits, self.group, self.scales.dtype, self.mins is None) + ((self.sup,) if self.coded else ()) + grid

    @staticmethod
    def cat(parts: list[QuantRows], what: str) -> QuantRows:
        """Rows of `parts` one after the other (q|k|v, gate|up). Parts the kernel reads alike (one
        `form`: Q5_0 beside Q8_0, say) are joined as they are. Parts it does not (llama.cpp's Q4_K_M
        puts a Q6_K v beside Q4_K q and k) are first brought to one form that holds every part's
        values exactly: 4-bit codes if all are, else 8-bit (unsigned with minimums, unless all are
        signed); fp16 scales if all are, else fp32; the block of k their blocks share (16 or 32).
        k-quant parts only (coded scales with one block of k per factor) keep their scale codes
        (`_common_coded_form`)."""
        if len({p.form for p in parts}) > 1:
            parts = [p.valued() for p in parts]  # (gridded parts beside others: as the bytes they stand for)
            coded = all(p.coded for p in parts) and len({p.sup for p in parts}) == 1
            parts = _common_coded_form(parts, what) if coded else _common_form(parts, what)
        first = parts[0]

        def cat(name):
            return None if getattr(first, name) is None else torch.cat([getattr(p, name) for p in parts])
        return QuantRows("+".join(dict.fromkeys(p.fmt for p in parts)), first.bits, cat("codes"), cat("scales"),
                         cat("mins"), cat("scale_d"), cat("min_d"), first.grid)


def _as_signed(p: QuantRows) -> QuantRows | None:
    """`p` as signed bytes without minimums where its minimums are -2^i x its scales (Q4_0 and Q5_0,
    held as unsigned codes with minimum -8 or -16 x scale), else None; signed parts as they are."""
    if p.mins is None:
        return p
    p = p.decoded()
    for off in (8, 16, 32, 64, 128):
        if torch.equal(p.mins.float(), p.scales.float() * -off):
            return QuantRows(p.fmt, 8, (p.codes.to(torch.int16) - off).to(torch.int8), p.scales)
    return None


def _shared_block(parts: list[QuantRows], what: str) -> tuple[int, int]:
    """The block of k `parts` share (the gcd of theirs) and the code bits that hold every part's
    codes there (8 for blocks of 16), or a QuantError where the kernel reads no such block."""
    group = math.gcd(*(p.group for p in parts))
    bits = max(p.bits for p in parts)
    bits = 8 if bits == 8 or (group % 32 and bits == 5) else bits  # (5-bit codes are read per 32 k)
    if group % 32 and group != 16:
        raise QuantError(f"{what}: its parts' blocks of {sorted({p.group for p in parts})} k share no block of "
                         "16 or 32 k that the kernel reads")
    return group, bits


def _offset(codes: torch.Tensor) -> int:
    """The smallest power of two (8 to 128) that makes signed `codes` unsigned: Q3_K's and Q4_0's
    -8..7 fit nibbles after it, Q6_K's -32..31 and Q8_0's -128..127 bytes."""
    low = int(codes.min()) if codes.numel() else 0
    return next(o for o in (8, 16, 32, 64, 128) if low >= -o)


def _common_coded_form(parts: list[QuantRows], what: str) -> list[QuantRows]:
    """k-quant `parts` (coded scales, one block of k per factor) in one coded form, the values
    unchanged: unsigned codes with minimums (5-bit if every part's fit, else bytes) and a scale and
    minimum code per the block of k they share (llama.cpp's Q4_K_M q and k beside a Q6_K v: bytes
    per 16 k, 9.25 bits a weight where multiplied-out scales read 12). A part without minimums
    (Q6_K, codes -32..31; Q3_K, -4..3) moves its codes up by 32 (8) and takes its scale codes as
    minimum codes under -32 (-8) x its scale factor: the minimum is then -32 (-8) x its scale,
    exactly."""
    group, bits = _shared_block(parts, what)
    log.info("%s: parts stored as %s, read as %d-bit codes with coded scales per %d k to be fused", what,
             "/".join(p.fmt for p in parts), bits, group)
    out = []
    for p in parts:
        codes, mins, min_d = p.codes, p.mins, p.min_d
        if mins is None:
            off = _offset(codes)
            codes, mins, min_d = codes.to(torch.int16) + off, p.scales, p.scale_d * -off
        r = p.group // group
        out.append(QuantRows(p.fmt, bits, codes.to(torch.uint8), p.scales.repeat_interleave(r, dim=1).contiguous(),
                             mins.repeat_interleave(r, dim=1).contiguous(), p.scale_d, min_d))
    return out


def _common_form(parts: list[QuantRows], what: str) -> list[QuantRows]:
    """`parts` in one form (QuantRows.cat), the values unchanged: 4- and 5-bit codes are 5- and 8-bit
    codes as they are, fp16 widens to fp32 exactly, and signed bytes become unsigned by adding the
    smallest power of two (32, 64 or 128) that does, with the minimum -that x scale (exact), or
    unsigned codes whose minimum is -2^i x scale become signed bytes (`_as_signed`); coded scales
    are multiplied out (`QuantRows.decoded`)."""
    parts = [p.decoded() for p in parts]
    group, bits = _shared_block(parts, what)
    signed = bits == 8 and all(_as_signed(p) is not None for p in parts)
    if signed:
        parts = [_as_signed(p) for p in parts]
    # (a signed nibble part's minimum, -8 x its fp16 scale, is an fp16 too)
    f16 = group % 32 == 0 and all(p.scales.dtype == torch.float16 and (signed or p.mins is not None or p.bits == 4)
                                  for p in parts)
    dtype = torch.float16 if f16 else torch.float32
    log.info("%s: parts stored as %s, read as %d-bit codes with %s scales per %d k to be fused", what,
             "/".join(p.fmt for p in parts), bits, "fp16" if f16 else "fp32", group)
    out = []
    for p in parts:
        codes, scales, mins = p.codes, p.scales.to(dtype), None if p.mins is None else p.mins.to(dtype)
        if not signed and mins is None:
            off = _offset(codes)
            codes, mins = codes.to(torch.int16) + off, scales * -off
        if not signed:
            codes = codes.to(torch.uint8)
        r = p.group // group
        out.append(QuantRows(p.fmt, bits, codes, scales.repeat_interleave(r, dim=1).contiguous(),
                             None if mins is None else mins.repeat_interleave(r, dim=1).contiguous()))
    return out


def fuse_rows(parts: list, what: str):
    """Matmul weights fused by rows (q|k|v, gate|up): tensors, or QuantRows of one format."""
    if any(isinstance(p, QuantRows) for p in parts):
        if not all(isinstance(p, QuantRows) for p in parts):
            raise ConfigError(f"checkpoint: {what}: some parts are quantized and some are not")
        return QuantRows.cat(parts, what)
    return torch.cat(parts).contiguous()


def quantize_int8(w: torch.Tensor) -> QuantRows:
    """Per-row symmetric int8 of a [n, k] weight: fp32 scales max |w[row]| / 127."""
    w = w.float()
    scale = w.abs().amax(dim=1, keepdim=True) / 127.0
    codes = torch.round(w / torch.where(scale > 0, scale, torch.ones_like(scale))).clamp_(-127, 127)
    return QuantRows("int8", 8, codes.to(torch.int8), scale.contiguous())


# 5-bit codes: where k = 8 wi + j of a block of 32 keeps its fifth bit in the block's word (j < 4:
# bit 8 j + 4 + wi, else 8 (j - 4) + wi), so one shift and mask put word wi's bits in bit 4 of its
# bytes (engine/csrc/quant.h)
FIFTH_BIT = torch.tensor([[8 * j + 4 + wi if j < 4 else 8 * (j - 4) + wi for j in range(8)] for wi in range(4)])


class QuantWeight:
    """A quantized [n, k] matmul weight in the native kernel's layout
    (engine/csrc/quant.h): q int32 [ceil(n/32), k / per, 32] (the unsigned
    codes of `per` = 32 / bits consecutive k of one row in a word: bytes in k
    order, or for 4 bits, byte j holding k = j and k = j + 4 in its low and high
    nibble), scales and mins [ceil(n/32), k / group, 32], padding rows zero.
    W = code * scale + min. Signed bytes (8-bit rows without minimums) are held
    + 128 with no minimums stored (`mins` empty): the minimum is -128 x scale,
    exact. Coded scales (QuantRows.coded): scales and mins int8 codes, and
    scale_d and min_d [ceil(n/32), k / sup, 32] fp32 their factors (else, and
    min_d without minimums, empty)."""

    __slots__ = ("fmt", "bits", "q", "scales", "mins", "scale_d", "min_d", "grid", "n", "k")

    def __init__(self, fmt: str, bits: int, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                 n: int, k: int, scale_d: torch.Tensor | None = None, min_d: torch.Tensor | None = None,
                 grid: torch.Tensor | None = None):
        self.fmt, self.bits, self.q, self.scales, self.mins, self.n, self.k = fmt, bits, q, scales, mins, n, k
        self.scale_d = scale_d if scale_d is not None else torch.empty(0)
        self.min_d = min_d if min_d is not None else torch.empty(0)
        self.grid = grid if grid is not None else torch.empty(0, dtype=torch.int8)

    @classmethod
    def pack(cls, rows: QuantRows) -> QuantWeight:
        n, k = rows.shape
        per = 4 if rows.bits == 8 else 8 if rows.bits == 4 else 32  # 5 bits: whole blocks of 32
        if k % per or rows.group % min(per, 16):
            raise QuantError(f"a {rows.fmt} weight needs k ({k}) and its block ({rows.group}) to be multiples "
                             f"of {per}")
        blocks = -(-n // BLOCK)
        pad = blocks * BLOCK - n
        codes, mins = rows.codes, rows.mins
        if mins is None and rows.grid is None:  # signed bytes (nibbles) -> unsigned, the minimum -128 (-8) x scale
            codes = (codes.to(torch.int16) + (128 if rows.bits == 8 else 8)).to(torch.uint8)
        codes = F.pad(codes.view(torch.uint8), (0, 0, 0, pad))  # [blocks * 32, k]
        fifth = None
        if rows.bits == 5:  # the fifth bits of each 32 k in one word: k 8 wi + j at bit FIFTH_BIT[wi, j]
            bits = (codes >> 4).reshape(-1, k // 32, 4, 8).to(torch.int64) << FIFTH_BIT
            fifth = bits.sum(dim=(-2, -1))  # [rows, k / 32], unsigned 32-bit values
            fifth = (fifth - ((fifth >> 31) << 32)).to(torch.int32)  # the same bits as int32
            codes = codes & 15
        if rows.bits != 8:  # byte j of a word: k = j in its low nibble, k = j + 4 in its high one
            halves = codes.reshape(-1, k // 8, 2, 4)
            codes = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(-1, k // 2)  # [rows, k / 2]
        words = codes.contiguous().view(torch.int32)  # [rows, k / 4 or k / 8], little-endian
        if fifth is not None:
            words = torch.cat([words, fifth], dim=1)
        q = words.reshape(blocks, BLOCK, -1).transpose(1, 2).contiguous()

        def by_block(t):
            return F.pad(t, (0, 0, 0, pad)).reshape(blocks, BLOCK, -1).transpose(1, 2).contiguous()
        scales = by_block(rows.scales)
        return cls(rows.fmt, rows.bits, q, scales, scales.new_empty(0) if mins is None else by_block(mins), n, k,
                   *(None if t is None else by_block(t) for t in (rows.scale_d, rows.min_d)), grid=rows.grid)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        """What a matmul reads: codes, scales and minimums (and the factors of coded ones)."""
        return sum(t.nbytes for t in self.tensors())

    def _codes(self, q: torch.Tensor) -> torch.Tensor:  # a column's int32 words [..., words] -> codes [..., k] float32
        q = q.contiguous()
        if self.bits == 8:
            return q.view(torch.uint8).float()
        b = q[..., :self.k // 8].contiguous().view(torch.uint8)
        b = b.reshape(*b.shape[:-1], -1, 4)  # [..., k / 8, 4]: a word's bytes
        codes = torch.cat([b & 15, b >> 4], dim=-1).flatten(-2)
        if self.bits == 5:
            hw = q[..., self.k // 8:].to(torch.int64) & 0xFFFFFFFF  # [..., k / 32]
            bits = (hw[..., None, None] >> FIFTH_BIT) & 1  # [..., k / 32, 4, 8]
            codes = codes + (bits.flatten(-3) << 4).to(codes.dtype)
        return codes.float()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The dequantized rows W[ids] [len(ids), k] float32 (the embedding lookup of a tied LM head)."""
        blk, col = ids // BLOCK, ids % BLOCK
        codes = self._codes(self.q[blk, :, col])  # [T, k]
        group = self.k // self.scales.shape[1]

        def values(t, f):  # [T, k / group] fp32: coded ones times their factors
            v = t[blk, :, col].float()
            if f.numel():
                v = f[blk, :, col].repeat_interleave(v.shape[1] // f.shape[1], dim=1) * v
            return v
        d = values(self.scales, self.scale_d)
        if self.grid.numel():  # indices -> the values they stand for, as gguf dequantizes them
            return self.grid[codes.long()].float() * d.repeat_interleave(group, dim=1)
        m = values(self.mins, self.min_d) if self.mins.numel() else d * -(128 if self.bits == 8 else 8)
        return torch.addcmul(m.repeat_interleave(group, dim=1), codes, d.repeat_interleave(group, dim=1))

    def dequantize(self) -> torch.Tensor:  # [n, k] float32
        return self.rows(torch.arange(self.n))

    def tensors(self) -> list[torch.Tensor]:
        """(codes, scales, mins, scale_d, min_d, grid) as the native kernels take them."""
        return [self.q, self.scales, self.mins, self.scale_d, self.min_d, self.grid]

    def with_tensors(self, q, scales, mins, scale_d, min_d, grid) -> QuantWeight:
        return QuantWeight(self.fmt, self.bits, q, scales, mins, self.n, self.k, scale_d, min_d, grid)


def _f16(b: np.ndarray) -> np.ndarray:  # [..., 2] bytes -> [...] float16
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _nibbles(b: np.ndarray) -> np.ndarray:  # [..., m] bytes -> [..., 2m]: every low nibble, then every high one
    return np.concatenate([b & 15, b >> 4], axis=-1)


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes of 6-bit scales and minimums -> ([..., 8], [..., 8]) for its 8 sub-blocks:
    bytes 0-3 hold scales 0-3 and bytes 4-7 minimums 0-3 in their low 6 bits, and the top 2 bits of
    scales 4-7 (minimums 4-7); bytes 8-11 hold the low 4 bits of scales 4-7 (high nibble: minimums)."""
    s, m, lo = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    sc = np.concatenate([s & 63, (lo & 15) | ((s >> 6) << 4)], axis=-1)
    mn = np.concatenate([m & 63, (lo >> 4) | ((m >> 6) << 4)], axis=-1)
    return sc, mn


def gguf_rows(data: np.ndarray, type_name: str, shape: tuple[int, int], what: str) -> QuantRows:
    """A GGUF tensor's raw blocks (uint8 [rows, bytes per row]) as QuantRows, the values
    unchanged: Q8_0, Q5_0, Q4_0, Q4_1, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL or IQ4_XS."""
    if type_name not in GGUF_FORMATS:
        raise QuantError(f"{what}: stored as {type_name}, which quantization 'gguf' does not keep "
                         f"(it keeps {', '.join(GGUF_FORMATS)}); use quantization 'int8' or 'none'")
    n, k = shape
    per, size, _ = GGUF_FORMATS[type_name]
    if k % per:
        raise QuantError(f"{what}: {type_name} rows of {k} weights are not whole blocks of {per}")
    raw = np.ascontiguousarray(data).reshape(n, k // per, size)

    def t(a: np.ndarray, dtype=None) -> torch.Tensor:  # [n, blocks, ...] -> [n, blocks * ...]
        a = np.ascontiguousarray(a if dtype is None else a.astype(dtype))
        return torch.from_numpy(a.reshape(n, -1))

    if type_name == "Q8_0":
        return QuantRows("q8_0", 8, t(raw[..., 2:].view(np.int8)), t(_f16(raw[..., :2])))
    if type_name == "Q5_0":  # d, 32 high bits (k j: bit j), 16 bytes of low nibbles (k j and j + 16 in byte j)
        high = (raw[..., 2:6].copy().view("<u4") >> np.arange(32, dtype=np.uint32)) & 1
        codes = _nibbles(raw[..., 6:]) | (high << 4).astype(np.uint8)
        d = t(_f16(raw[..., :2]))
        return QuantRows("q5_0", 5, t(codes, np.int8), d, -16 * d)  # W = d (code - 16): fp16 holds -16 d
    if type_name == "Q5_1":  # d, m, 32 high bits, 16 bytes of low nibbles: W = d code + m, codes 0..31
        high = (raw[..., 4:8].copy().view("<u4") >> np.arange(32, dtype=np.uint32)) & 1
        codes = _nibbles(raw[..., 8:]) | (high << 4).astype(np.uint8)
        return QuantRows("q5_1", 5, t(codes, np.int8), t(_f16(raw[..., :2])), t(_f16(raw[..., 2:4])))
    if type_name in ("Q4_0", "Q4_1"):
        d = t(_f16(raw[..., :2]))
        if type_name == "Q4_0":  # W = d (code - 8): signed nibbles (held + 8, the minimum -8 d implied)
            return QuantRows("q4_0", 4, t(_nibbles(raw[..., 2:]).astype(np.int8) - 8), d)
        return QuantRows("q4_1", 4, t(_nibbles(raw[..., 4:]), np.int8), d, t(_f16(raw[..., 2:4])))
    if type_name == "IQ4_NL":  # d, 16 bytes of indices (k j low nibble of byte j, k 16 + j high)
        return QuantRows("iq4_nl", 4, t(_nibbles(raw[..., 2:]), np.int8), t(_f16(raw[..., :2])), grid=IQ4_GRID)
    if type_name == "IQ4_XS":  # d, 2 bytes of the scales' top 2 bits (sub-block i: bits 2i, 2i + 1), 4 bytes
        # of their low 4 bits (sub-block 2i: low nibble of byte i, 2i + 1 high), 8 runs of 16 bytes of indices
        d = _f16(raw[..., :2]).astype(np.float32)
        high = (raw[..., 2:4].copy().view("<u2") >> (2 * np.arange(8, dtype=np.uint16))) & 3
        low = np.stack([raw[..., 4:8] & 15, raw[..., 4:8] >> 4], axis=-1).reshape(n, k // per, 8)
        sc = (low | (high.astype(np.uint8) << 4)).astype(np.int8) - 32
        idx = _nibbles(raw[..., 8:].reshape(n, k // per, 8, 16))
        return QuantRows("iq4_xs", 4, t(idx, np.int8), t(sc), None, t(d), grid=IQ4_GRID)
    if type_name in ("Q2_K", "Q3_K"):  # 2-bit codes in 64 bytes: k 128 i + 32 s + j in bits 2s, 2s + 1 of byte 32 i + j
        lo_at = 16 if type_name == "Q2_K" else 32
        low = (raw[..., lo_at:lo_at + 64].reshape(n, k // per, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
        low = low.reshape(n, k // per, 256)
        if type_name == "Q2_K":  # 16 bytes of 4-bit scale (low) and minimum (high) codes per 16 k, codes, d, dmin
            d, dmin = _f16(raw[..., 80:82]).astype(np.float32), _f16(raw[..., 82:84]).astype(np.float32)
            sm = raw[..., :16]
            return QuantRows("q2_k", 4, t(low, np.int8), t(sm & 15, np.int8), t(sm >> 4, np.int8), t(d), t(-dmin))
        # Q3_K: 32 bytes of high bits (k 32 b + j: bit b of byte j; code - 4 where it is 0), the low bits,
        # 12 bytes of 6-bit scales - 32 (low nibbles in bytes 0-7: scale i, high nibble i + 8; top 2 bits
        # of scale 4 s + i at bit 2 s of byte 8 + i), d
        high = (raw[..., :32].reshape(n, k // per, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 1
        codes = low.astype(np.int8) - 4 * (1 - high.reshape(n, k // per, 256)).astype(np.int8)
        sb = raw[..., 96:108]
        lo4 = np.concatenate([sb[..., :8] & 15, sb[..., :8] >> 4], axis=-1)
        hi2 = (sb[..., 8:12].reshape(n, k // per, 1, 4) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
        sc = (lo4 | (hi2.reshape(n, k // per, 16) << 4)).astype(np.int8) - 32
        return QuantRows("q3_k", 4, t(codes), t(sc), None, t(_f16(raw[..., 108:110]).astype(np.float32)))
    if type_name == "Q4_K":  # d, dmin, 12 bytes of scales, then 4 runs of 32 bytes: k 64 r + j low, + 32 + j high
        d, dmin = _f16(raw[..., :2]).astype(np.float32), _f16(raw[..., 2:4]).astype(np.float32)
        sc, mn = _k_scales(raw[..., 4:16])
        codes = _nibbles(raw[..., 16:].reshape(n, k // per, 4, 32))
        return QuantRows("q4_k", 4, t(codes, np.int8), t(sc, np.int8), t(mn, np.int8), t(d), t(-dmin))
    if type_name == "Q5_K":  # as Q4_K, with 32 bytes of fifth bits between: k 32 i + j in bit i of byte j
        d, dmin = _f16(raw[..., :2]).astype(np.float32), _f16(raw[..., 2:4]).astype(np.float32)
        sc, mn = _k_scales(raw[..., 4:16])
        high = (raw[..., 16:48].reshape(n, k // per, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 1
        codes = _nibbles(raw[..., 48:].reshape(n, k // per, 4, 32)).reshape(n, k // per, 8, 32) | (high << 4)
        return QuantRows("q5_k", 5, t(codes, np.int8), t(sc, np.int8), t(mn, np.int8), t(d), t(-dmin))
    # Q6_K: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (one per 16 k), d. Each half of
    # 128 k: low nibbles of its 64 bytes for k 0-63, high nibbles for 64-127; its 32 high bytes hold
    # k 32 r + j in bits 2r, 2r + 1 of byte j.
    low = _nibbles(raw[..., :128].reshape(n, k // per, 2, 64))
    high = (raw[..., 128:192].reshape(n, k // per, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    codes = (low | (high.reshape(low.shape) << 4)).astype(np.int16) - 32
    d = _f16(raw[..., 208:210]).astype(np.float32)
    return QuantRows("q6_k", 8, t(codes, np.int8), t(raw[..., 192:208].view(np.int8)), None, t(d))


def held_five_bit(rows: QuantRows) -> QuantRows:
    """5-bit `rows` as bytes, the values unchanged: signed bytes where the minimum is -16 x scale
    (Q5_0), else unsigned bytes with their minimums (Q5_1, Q5_K); other rows as they are."""
    if rows.bits != 5:
        return rows
    signed = _as_signed(rows)
    return signed if signed is not None else QuantRows(rows.fmt, 8, rows.codes, rows.scales, rows.mins,
                                                       rows.scale_d, rows.min_d)


def read_gguf_rows(path: Path) -> tuple[dict, dict[str, torch.Tensor | QuantRows]]:
    """The config.json dict and the tensors of GGUF file `path` under their HF names:
    matmul weights and embeddings (2-D) as QuantRows in their own format, the rest
    (norms, biases, a mixture of experts' routers) float32. The q/k rows are un-permuted
    as the fp32 conversion does; stacked experts [E, ...] become one QuantRows per expert
    (each expert's rows are contiguous blocks of the file)."""
    import gguf
    from gguf.quants import dequantize

    from engine.gguf_convert import (EXPERTS_RE, FP32_MATRICES, PERMUTED_QK_ARCHITECTURES, check_expert_tensors,
                                     expert_tensor_name, gguf_config, hf_tensor_name, unpermute_qk)
    from engine.weights import CheckpointError

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises bare ValueError/struct errors on bad files
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from e
    config = gguf_config(reader, path)
    check_expert_tensors(reader, path, config)
    permuted = config["model_type"] in PERMUTED_QK_ARCHITECTURES
    heads = {".self_attn.q_proj.": config["num_attention_heads"], ".self_attn.k_proj.": config["num_key_value_heads"]}
    out: dict[str, torch.Tensor | QuantRows] = {}

    five_bit = os.environ.get(FIVE_BIT_ENV, "widen")
    if five_bit not in FIVE_BIT_FORMS:
        raise CheckpointError(f"{FIVE_BIT_ENV}={five_bit!r}: must be one of {', '.join(FIVE_BIT_FORMS)}")

    def rows(data, type_name: str, shape, what: str) -> QuantRows:
        try:
            r = gguf_rows(data, type_name, shape, what)
        except QuantError as e:
            raise CheckpointError(str(e)) from e
        return held_five_bit(r) if five_bit == "widen" else r

    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        experts = EXPERTS_RE.fullmatch(t.name)
        if experts:
            for e in range(shape[0]):
                out[expert_tensor_name(experts, e)] = rows(t.data[e], t.tensor_type.name, shape[1:],
                                                           f"{path}: tensor {t.name!r}")
            continue
        name = hf_tensor_name(t.name)
        if name is None:
            continue
        if len(shape) == 1 or name.rsplit(".", 2)[-2] in FP32_MATRICES:
            w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape))
            out[name] = w.reshape(1, -1) if name.endswith(".shared_expert_gate.weight") else w
            continue
        w = rows(t.data, t.tensor_type.name, shape, f"{path}: tensor {t.name!r}")
        for part, num_heads in heads.items():
            if permuted and part in name:
                w = w.map_rows(lambda x, h=num_heads: unpermute_qk(x, h).contiguous())
        out[name] = w
    return config, out
