"""Quantized matmul weights, kept quantized (EngineConfig.quantization).

- ``int8``: per-output-row symmetric int8 made at load from any checkpoint
  (`quantize_int8`): code = round(w / s), s = max |w[row]| / 127, fp32 scales.
- ``gguf``: a GGUF file's own block formats, read as stored (`read_gguf_rows`):
  Q8_0 (32 signed bytes and an fp16 scale per block of 32), Q4_1 (32 nibbles,
  an fp16 scale and minimum) and Q4_0 (nibbles - 8, held as Q4_1 with the
  minimum -8 x scale, which fp16 holds exactly).

A weight is read in row form (`QuantRows`: codes one per byte, so rows can be
concatenated, permuted and checked like a tensor), then packed once into the
layout the native kernel streams (`QuantWeight`, engine/csrc/quant.h), where
the codes of consecutive k of one row share a 32-bit word. The model computes
with fp32 activations; every matmul is that of the dequantized weights
(`QuantWeight.dequantize`), up to summation order.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from engine.config import ConfigError

QUANTIZATIONS = ("none", "int8", "gguf")
BLOCK = 32  # output rows per packed block (engine/csrc/isa.h kPackedCols); also a GGUF block's k
# GGUF block type -> (bytes per block of 32, code bits)
GGUF_FORMATS = {"Q8_0": (34, 8), "Q4_0": (18, 4), "Q4_1": (20, 4)}


class QuantError(ValueError):
    """A weight cannot be held in the asked-for quantized format; the message names it."""


@dataclass
class QuantRows:
    """A quantized [n, k] weight by rows. codes: int8 [n, k] (signed bytes for
    bits 8, 0..15 for bits 4); scales: [n, k // group] fp16 (GGUF) or fp32
    (int8); mins: the same, or None. W = codes * scales (+ mins), per group of
    `group` consecutive k."""

    fmt: str  # "q8_0", "q4_1" or "int8"
    bits: int
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def group(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]

    def map_rows(self, fn) -> QuantRows:
        """The same weight with `fn` (a row permutation, a slice) applied to every part's rows."""
        return QuantRows(self.fmt, self.bits, fn(self.codes), fn(self.scales),
                         None if self.mins is None else fn(self.mins))

    def dequantize(self) -> torch.Tensor:  # [n, k] float32
        d = self.scales.float().repeat_interleave(self.group, dim=1)
        if self.mins is None:
            return self.codes.float() * d
        return torch.addcmul(self.mins.float().repeat_interleave(self.group, dim=1), self.codes.float(), d)

    @staticmethod
    def cat(parts: list[QuantRows], what: str) -> QuantRows:
        """Rows of `parts` one after the other (q|k|v, gate|up): one format, one group size."""
        first = parts[0]
        for p in parts[1:]:
            if (p.fmt, p.group, p.scales.dtype) != (first.fmt, first.group, first.scales.dtype):
                raise QuantError(f"{what}: its parts are stored as {first.fmt} and {p.fmt} (or with other "
                                 "block sizes); a fused matmul needs them in one format")
        return QuantRows(first.fmt, first.bits, torch.cat([p.codes for p in parts]),
                         torch.cat([p.scales for p in parts]),
                         None if first.mins is None else torch.cat([p.mins for p in parts]))


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


class QuantWeight:
    """A quantized [n, k] matmul weight in the native kernel's layout
    (engine/csrc/quant.h): q int32 [ceil(n/32), k / per, 32] (the unsigned
    codes of `per` = 32 / bits consecutive k of one row in a word: bytes in k
    order, or for 4 bits, byte j holding k = j and k = j + 4 in its low and high
    nibble; signed bytes are held + 128 with min -128 x scale, which both fp16
    and fp32 hold exactly), scales and mins [ceil(n/32), k / group, 32], padding
    rows zero. W = code * scale + min."""

    __slots__ = ("fmt", "bits", "q", "scales", "mins", "n", "k")

    def __init__(self, fmt: str, bits: int, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                 n: int, k: int):
        self.fmt, self.bits, self.q, self.scales, self.mins, self.n, self.k = fmt, bits, q, scales, mins, n, k

    @classmethod
    def pack(cls, rows: QuantRows) -> QuantWeight:
        n, k = rows.shape
        per = 32 // rows.bits
        if k % per or rows.group % per:
            raise QuantError(f"a {rows.fmt} weight needs k ({k}) and its block ({rows.group}) to be multiples "
                             f"of {per}")
        blocks = -(-n // BLOCK)
        pad = blocks * BLOCK - n
        codes, mins = rows.codes, rows.mins
        if rows.bits == 8:  # signed bytes -> unsigned, the offset moved into the minimum
            codes = (codes.to(torch.int16) + 128).to(torch.uint8)
            mins = rows.scales * -128
        codes = F.pad(codes.view(torch.uint8), (0, 0, 0, pad))  # [blocks * 32, k]
        if rows.bits == 4:  # byte j of a word: k = j in its low nibble, k = j + 4 in its high one
            halves = codes.reshape(-1, k // 8, 2, 4)
            codes = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(-1, k // 2)  # [rows, k / 2]
        words = codes.contiguous().view(torch.int32)  # [rows, k / per], little-endian
        q = words.reshape(blocks, BLOCK, k // per).transpose(1, 2).contiguous()

        def by_block(t):
            return None if t is None else F.pad(t, (0, 0, 0, pad)).reshape(blocks, BLOCK, -1).transpose(1, 2).contiguous()
        return cls(rows.fmt, rows.bits, q, by_block(rows.scales), by_block(mins), n, k)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        """What a matmul reads: codes, scales and minimums."""
        return self.q.nbytes + self.scales.nbytes + self.mins.nbytes

    def _codes(self, q: torch.Tensor) -> torch.Tensor:  # int32 words [..., k / per] -> codes [..., k] float32
        b = q.contiguous().view(torch.uint8)  # [..., k / per * 4]
        if self.bits == 8:
            return b.float()
        b = b.reshape(*b.shape[:-1], -1, 4)  # [..., k / 8, 4]: a word's bytes
        return torch.cat([b & 15, b >> 4], dim=-1).flatten(-2).float()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The dequantized rows W[ids] [len(ids), k] float32 (the embedding lookup of a tied LM head)."""
        blk, col = ids // BLOCK, ids % BLOCK
        codes = self._codes(self.q[blk, :, col])  # [T, k]
        group = self.k // self.scales.shape[1]
        d = self.scales[blk, :, col].float().repeat_interleave(group, dim=1)
        return torch.addcmul(self.mins[blk, :, col].float().repeat_interleave(group, dim=1), codes, d)

    def dequantize(self) -> torch.Tensor:  # [n, k] float32
        return self.rows(torch.arange(self.n))

    def tensors(self) -> list[torch.Tensor]:
        """(codes, scales, mins) as the native kernels take them."""
        return [self.q, self.scales, self.mins]

    def with_tensors(self, q, scales, mins) -> QuantWeight:
        return QuantWeight(self.fmt, self.bits, q, scales, mins, self.n, self.k)


def gguf_rows(data: np.ndarray, type_name: str, shape: tuple[int, int], what: str) -> QuantRows:
    """A GGUF tensor's raw blocks (uint8 [rows, bytes per row]) as QuantRows, the values
    unchanged: Q8_0, Q4_0 (as Q4_1 with minimum -8 x scale) or Q4_1."""
    if type_name not in GGUF_FORMATS:
        raise QuantError(f"{what}: stored as {type_name}, which quantization 'gguf' does not keep "
                         f"(it keeps {', '.join(GGUF_FORMATS)}); use quantization 'int8' or 'none'")
    n, k = shape
    size, bits = GGUF_FORMATS[type_name]
    raw = np.ascontiguousarray(data).reshape(n, k // BLOCK, size)
    d = torch.from_numpy(raw[..., :2].copy().view(np.float16).reshape(n, k // BLOCK))
    if type_name == "Q8_0":
        codes = torch.from_numpy(raw[..., 2:].copy().view(np.int8).reshape(n, k))
        return QuantRows("q8_0", 8, codes, d)
    qs = raw[..., 4:] if type_name == "Q4_1" else raw[..., 2:]  # 16 bytes: k j and j + 16 in byte j
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int8).reshape(n, k)
    m = torch.from_numpy(raw[..., 2:4].copy().view(np.float16).reshape(n, k // BLOCK)) if type_name == "Q4_1" \
        else -8 * d
    return QuantRows("q4_1", 4, torch.from_numpy(codes), d, m)


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

    def rows(data, type_name: str, shape, what: str) -> QuantRows:
        try:
            return gguf_rows(data, type_name, shape, what)
        except QuantError as e:
            raise CheckpointError(str(e)) from e

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
