"""Quantized matmul weights, kept quantized (EngineConfig.quantization).

- ``int8``: per-output-row symmetric int8 made at load from any checkpoint
  (`quantize_int8`): code = round(w / s), s = max |w[row]| / 127, fp32 scales.
- ``gguf``: a GGUF file's own block formats, read as stored (engine/gguf_blocks.py,
  `read_gguf_rows`): codes, scales (or scale codes under a super-block's factors) and a grid
  of values where the codes are indices, as `QuantRows` below holds them.

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
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.config import ConfigError

log = logging.getLogger(__name__)

QUANTIZATIONS = ("none", "int8", "gguf")
BLOCK = 32  # output rows per packed block (engine/csrc/isa.h kPackedCols); also a GGUF block's k


def signed_offset(bits: int) -> int:
    """What signed codes without minimums are held + (the minimum is -that x scale): 128 for bytes,
    8 for nibbles (engine/csrc/quant.h signed_offset)."""
    return 128 if bits == 8 else 8


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


def as_signed(p: QuantRows) -> QuantRows | None:
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
    unsigned codes whose minimum is -2^i x scale become signed bytes (`as_signed`); coded scales
    are multiplied out (`QuantRows.decoded`)."""
    parts = [p.decoded() for p in parts]
    group, bits = _shared_block(parts, what)
    signed = bits == 8 and all(as_signed(p) is not None for p in parts)
    if signed:
        parts = [as_signed(p) for p in parts]
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
            codes = (codes.to(torch.int16) + signed_offset(rows.bits)).to(torch.uint8)
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
        m = values(self.mins, self.min_d) if self.mins.numel() else d * -signed_offset(self.bits)
        return torch.addcmul(m.repeat_interleave(group, dim=1), codes, d.repeat_interleave(group, dim=1))

    def dequantize(self) -> torch.Tensor:  # [n, k] float32
        return self.rows(torch.arange(self.n))

    def tensors(self) -> list[torch.Tensor]:
        """(codes, scales, mins, scale_d, min_d, grid) as the native kernels take them."""
        return [self.q, self.scales, self.mins, self.scale_d, self.min_d, self.grid]

    def with_tensors(self, q, scales, mins, scale_d, min_d, grid) -> QuantWeight:
        return QuantWeight(self.fmt, self.bits, q, scales, mins, self.n, self.k, scale_d, min_d, grid)
