"""Writes GGUF k-quant blocks (Q4_K, Q5_K, Q6_K) from fp32 weights, for test
and benchmark checkpoints: gguf's Python package reads these formats but does
not write them. Round to nearest with each sub-block's range for its scale, not
llama.cpp's searched scales: the values are what the reader must reproduce,
their fit to the weights matters less."""
from __future__ import annotations

import numpy as np

QK = 256


def _f16_bytes(v: np.ndarray) -> np.ndarray:  # [...] -> [..., 2] uint8
    return v.astype(np.float16)[..., None].view(np.uint8)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:  # 6-bit [..., 8] each -> [..., 12] bytes
    lo_s, hi_s, lo_m, hi_m = sc[..., :4], sc[..., 4:], mn[..., :4], mn[..., 4:]
    return np.concatenate([lo_s | ((hi_s >> 4) << 6), lo_m | ((hi_m >> 4) << 6), (hi_s & 15) | ((hi_m & 15) << 4)],
                          axis=-1).astype(np.uint8)


def _affine(x: np.ndarray, levels: int):
    """x [..., 8, 32] -> fp16 d, dmin [...], 6-bit sc, m [..., 8], codes [..., 8, 32] in 0..levels."""
    lo = np.minimum(x.min(-1), 0)
    step = (x.max(-1) - lo) / levels
    d = (step.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (-lo.min(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(step / np.where(d > 0, d, 1)[..., None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-lo / np.where(dmin > 0, dmin, 1)[..., None]), 0, 63).astype(np.uint8)
    scale, mins = d[..., None] * sc, dmin[..., None] * m
    q = np.round((x + mins[..., None]) / np.where(scale > 0, scale, 1)[..., None])
    return d, dmin, sc, m, np.clip(q, 0, levels).astype(np.uint8)


def _nibble_runs(q: np.ndarray) -> np.ndarray:  # codes [..., 8, 32] -> [..., 128]: run r holds 64 r + j | 64 r + 32 + j
    q = q.reshape(*q.shape[:-2], 4, 2, 32) & 15
    return (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(*q.shape[:-3], 128)


def quantize(w: np.ndarray, type_name: str) -> np.ndarray:
    """w float32 [n, k], k a multiple of 256 -> raw blocks uint8 [n, k / 256 * block bytes]."""
    n, k = w.shape
    assert k % QK == 0, f"{type_name} needs rows of a multiple of {QK} weights, got {k}"
    x = w.astype(np.float32).reshape(n, k // QK, 8, 32)
    if type_name in ("Q4_K", "Q5_K"):
        d, dmin, sc, m, q = _affine(x, 15 if type_name == "Q4_K" else 31)
        parts = [_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, m)]
        if type_name == "Q5_K":
            bits = (q >> 4) & 1  # [.., 8, 32]: bit i of byte j is k 32 i + j
            parts.append((bits << np.arange(8, dtype=np.uint8)[:, None]).sum(-2).astype(np.uint8))
        parts.append(_nibble_runs(q))
    elif type_name == "Q6_K":
        g = x.reshape(n, k // QK, 16, 16)
        amax_i = np.abs(g).argmax(-1)
        peak = np.take_along_axis(g, amax_i[..., None], -1)[..., 0]  # the signed largest of each 16
        step = -peak / 32
        d = (np.abs(step).max(-1) / 127).astype(np.float16).astype(np.float32)
        sc = np.clip(np.round(step / np.where(d > 0, d, 1)[..., None]), -128, 127).astype(np.int8)
        scale = d[..., None] * sc
        q = np.clip(np.round(g / np.where(scale != 0, scale, 1)[..., None]) + 32, 0, 63).astype(np.uint8)
        q = q.reshape(n, k // QK, 2, 128)  # halves of 128
        lo = q[..., :64] & 15 | ((q[..., 64:] & 15) << 4)  # [.., 2, 64]
        hi = ((q.reshape(n, k // QK, 2, 4, 32) >> 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(-2)
        parts = [lo.reshape(n, k // QK, 128), hi.astype(np.uint8).reshape(n, k // QK, 64), sc.view(np.uint8),
                 _f16_bytes(d)]
    else:
        raise ValueError(f"no writer for {type_name}")
    return np.concatenate(parts, axis=-1).reshape(n, -1)
