"""GGUF tensors read as stored, for quantization "gguf" (`read_gguf_rows`; engine/quant.py holds
and packs them): a GGUF file's own block formats, as `QuantRows`, the values unchanged:
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
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from engine.quant import QuantError, QuantRows, as_signed

# How 5-bit GGUF codes (Q5_0, Q5_1, Q5_K) are held: "widen" (default) to bytes, Q5_0 as signed bytes
# like Q8_0 (8.5 bits read per weight, not 6.0); "keep" at 5 bits (a nibble plane and a word of
# fifth bits per 32 k). Measured side by side on the default model in llama.cpp's Q4_K_M layout
# (BENCHMARKS.md): on a Zen 4 the 5-bit tile's extra shifts cost more than the 16% fewer bytes save
# (single stream 0.88x / 0.83x of the bytes form on avx512bf16 / avx2 at 1 thread, 0.98x / 0.91x at
# 2); "keep" is for machines with less bandwidth per core, where a step is bound by bytes.
FIVE_BIT_ENV = "KVRELAY_GGUF_FIVE_BIT"
FIVE_BIT_FORMS = ("widen", "keep")

# GGUF block type -> (weights per block, bytes per block, code bits as held)
GGUF_FORMATS = {"Q8_0": (32, 34, 8), "Q4_0": (32, 18, 4), "Q4_1": (32, 20, 4), "Q5_0": (32, 22, 5),
                "Q5_1": (32, 24, 5), "Q2_K": (256, 84, 4), "Q3_K": (256, 110, 4), "Q4_K": (256, 144, 4),
                "Q5_K": (256, 176, 5), "Q6_K": (256, 210, 8), "IQ4_NL": (32, 18, 4), "IQ4_XS": (256, 136, 4)}
# IQ4_NL and IQ4_XS: a 4-bit index per weight into these values (llama.cpp's non-linear grid)
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
IQ4_GRID = torch.from_numpy(IQ4_VALUES)


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
    signed = as_signed(rows)
    return signed if signed is not None else QuantRows(rows.fmt, 8, rows.codes, rows.scales, rows.mins,
                                                       rows.scale_d, rows.min_d)


def read_gguf_rows(path: Path) -> tuple[dict, dict[str, torch.Tensor | QuantRows]]:
    """The config.json dict and the tensors of GGUF file `path` under their HF names:
    matmul weights and embeddings (2-D) as QuantRows in their own format, the rest
    (norms, biases, a mixture of experts' routers) float32. The q/k rows are un-permuted
    as the fp32 conversion does; stacked experts [E, ...] become one QuantRows per expert
    (each expert's rows are contiguous blocks of the file)."""
    from gguf.quants import dequantize

    from engine.gguf_convert import (EXPERTS_RE, FP32_MATRICES, PERMUTED_QK_ARCHITECTURES, expert_tensor_name,
                                     hf_tensor_name, open_gguf, unpermute_qk)
    from engine.weights import CheckpointError

    reader, config = open_gguf(path)
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
