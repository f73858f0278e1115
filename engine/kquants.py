"""Writes GGUF k-quant blocks (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) and IQ4_NL / IQ4_XS blocks from fp32 weights, for test and
benchmark checkpoints: gguf's Python package reads these formats but does not
write them. Round to nearest with each sub-block's range for its scale, not
llama.cpp's searched scales (or an importance matrix): the values are what a
reader must reproduce, their fit to the weights is coarser than llama.cpp's.

    python -m engine.kquants IN.gguf OUT.gguf [--layout q4_k_m]

rewrites a GGUF's matmul weights in the mix of types llama.cpp's Q4_K_M gives
(`q4_k_m_type`), from the input's dequantized values: a benchmark file of the
layout users download, for models whose real one is not at hand."""
from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

QK = 256


def _f16_bytes(v: np.ndarray) -> np.ndarray:  # [...] -> [..., 2] uint8
    return v.astype(np.float16)[..., None].view(np.uint8)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:  # 6-bit [..., 8] each -> [..., 12] bytes
    lo_s, hi_s, lo_m, hi_m = sc[..., :4], sc[..., 4:], mn[..., :4], mn[..., 4:]
    return np.concatenate([lo_s | ((hi_s >> 4) << 6), lo_m | ((hi_m >> 4) << 6), (hi_s & 15) | ((hi_m & 15) << 4)],
                          axis=-1).astype(np.uint8)


def _affine(x: np.ndarray, levels: int, scale_max: int = 63):
    """x [..., G, S] (G sub-blocks of S) -> fp16 d, dmin [...], sc, m [..., G] in 0..scale_max,
    codes [..., G, S] in 0..levels."""
    lo = np.minimum(x.min(-1), 0)
    step = (x.max(-1) - lo) / levels
    d = (step.max(-1) / scale_max).astype(np.float16).astype(np.float32)
    dmin = (-lo.min(-1) / scale_max).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(step / np.where(d > 0, d, 1)[..., None]), 0, scale_max).astype(np.uint8)
    m = np.clip(np.round(-lo / np.where(dmin > 0, dmin, 1)[..., None]), 0, scale_max).astype(np.uint8)
    scale, mins = d[..., None] * sc, dmin[..., None] * m
    q = np.round((x + mins[..., None]) / np.where(scale > 0, scale, 1)[..., None])
    return d, dmin, sc, m, np.clip(q, 0, levels).astype(np.uint8)


def _nibble_runs(q: np.ndarray) -> np.ndarray:  # codes [..., 8, 32] -> [..., 128]: run r holds 64 r + j | 64 r + 32 + j
    q = q.reshape(*q.shape[:-2], 4, 2, 32) & 15
    return (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(*q.shape[:-3], 128)


def _two_bit_runs(q: np.ndarray) -> np.ndarray:  # codes 0..3 [..., 256] -> [..., 64]
    # (k 128 i + 32 s + j at bit 2 s of byte 32 i + j)
    q = q.reshape(*q.shape[:-1], 2, 4, 32).astype(np.uint8)
    return (q << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(-2).astype(np.uint8).reshape(*q.shape[:-3], 64)


def _signed_scales(g: np.ndarray, low: int, scale_max: int):
    """g [..., 16, 16] -> fp16 d [...], signed scale codes [..., 16] in -scale_max-1..scale_max, and
    codes [..., 16, 16] in low..-low-1: each 16's signed largest lands on `low`."""
    peak = np.take_along_axis(g, np.abs(g).argmax(-1)[..., None], -1)[..., 0]
    step = peak / low
    d = (np.abs(step).max(-1) / scale_max).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(step / np.where(d > 0, d, 1)[..., None]), -scale_max - 1, scale_max).astype(np.int8)
    scale = d[..., None] * sc
    q = np.clip(np.round(g / np.where(scale != 0, scale, 1)[..., None]), low, -low - 1)
    return d, sc, q.astype(np.int8)


def _iq4_steps(x: np.ndarray) -> np.ndarray:
    """x [..., 32] -> a signed step per 32 [...]: the largest |x| of each lands on -127."""
    return -np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0] / 127


def _iq4_indices(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """x [..., 32] and its rounded scale per 32 [...] -> the nearest IQ4 value's index [..., 32], uint8."""
    from engine.gguf_blocks import IQ4_VALUES

    v = x / np.where(scale != 0, scale, 1)[..., None]
    return np.abs(v[..., None] - IQ4_VALUES.astype(np.float32)).argmin(-1).astype(np.uint8)


def quantize(w: np.ndarray, type_name: str) -> np.ndarray:
    """w float32 [n, k], k a multiple of 256 (of 32 for IQ4_NL) -> raw blocks uint8 [n, k / 256 * block bytes]."""
    n, k = w.shape
    if type_name == "IQ4_NL":  # d, 16 bytes of indices: k j in the low nibble of byte j, k 16 + j in its high
        x = w.astype(np.float32).reshape(n, k // 32, 32)
        d = _iq4_steps(x).astype(np.float16).astype(np.float32)
        i = _iq4_indices(x, d)
        return np.concatenate([_f16_bytes(d), i[..., :16] | (i[..., 16:] << 4)], axis=-1).reshape(n, -1)
    assert k % QK == 0, f"{type_name} needs rows of a multiple of {QK} weights, got {k}"
    x = w.astype(np.float32).reshape(n, k // QK, 8, 32)
    if type_name in ("Q4_K", "Q5_K"):
        d, dmin, sc, m, q = _affine(x, 15 if type_name == "Q4_K" else 31)
        parts = [_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, m)]
        if type_name == "Q5_K":
            bits = (q >> 4) & 1  # [.., 8, 32]: bit i of byte j is k 32 i + j
            parts.append((bits << np.arange(8, dtype=np.uint8)[:, None]).sum(-2).astype(np.uint8))
        parts.append(_nibble_runs(q))
    elif type_name == "Q2_K":  # 4-bit scale and minimum codes per 16 (low, high nibble), codes, d, dmin
        d, dmin, sc, m, q = _affine(x.reshape(n, k // QK, 16, 16), 3, 15)
        parts = [sc | (m << 4), _two_bit_runs(q.reshape(n, k // QK, 256)), _f16_bytes(d), _f16_bytes(dmin)]
    elif type_name == "Q3_K":  # high bits (set where code >= 0), low 2 bits, 6-bit scales + 32, d
        d, sc, q = _signed_scales(x.reshape(n, k // QK, 16, 16), -4, 31)
        q = q.reshape(n, k // QK, 256)
        high = (q >= 0).astype(np.uint8).reshape(n, k // QK, 8, 32)  # k 32 b + j: bit b of byte j
        s6 = (sc.astype(np.int16) + 32).astype(np.uint8)  # 0..63
        lo4, hi2 = s6 & 15, (s6 >> 4).reshape(n, k // QK, 4, 4)  # top 2 bits of scale 4 s + i: bit 2 s of byte 8 + i
        parts = [(high << np.arange(8, dtype=np.uint8)[:, None]).sum(-2).astype(np.uint8),
                 _two_bit_runs((q + 4 * (q < 0)).astype(np.uint8)),
                 lo4[..., :8] | (lo4[..., 8:] << 4),
                 (hi2 << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(-2).astype(np.uint8),
                 _f16_bytes(d)]
    elif type_name == "IQ4_XS":  # d, the scales' top 2 bits, their low 4 bits, 8 runs of 16 bytes of indices
        step = _iq4_steps(x)  # [n, k / 256, 8]
        d = (np.abs(step).max(-1) / 31).astype(np.float16).astype(np.float32)
        ls = np.clip(np.round(step / np.where(d > 0, d, 1)[..., None]), -32, 31).astype(np.int16) + 32  # 0..63
        i = _iq4_indices(x, d[..., None] * (ls - 32))
        high = ((ls >> 4).astype(np.uint16) << (2 * np.arange(8, dtype=np.uint16))).sum(-1).astype(np.uint16)
        low = (ls & 15).astype(np.uint8)
        parts = [_f16_bytes(d), high[..., None].view(np.uint8), low[..., 0::2] | (low[..., 1::2] << 4),
                 (i[..., :16] | (i[..., 16:] << 4)).reshape(n, k // QK, 128)]
    elif type_name == "Q6_K":
        d, sc, q = _signed_scales(x.reshape(n, k // QK, 16, 16), -32, 127)
        q = (q.astype(np.int16) + 32).astype(np.uint8).reshape(n, k // QK, 2, 128)  # halves of 128
        lo = q[..., :64] & 15 | ((q[..., 64:] & 15) << 4)  # [.., 2, 64]
        hi = ((q.reshape(n, k // QK, 2, 4, 32) >> 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(-2)
        parts = [lo.reshape(n, k // QK, 128), hi.astype(np.uint8).reshape(n, k // QK, 64), sc.view(np.uint8),
                 _f16_bytes(d)]
    else:
        raise ValueError(f"no writer for {type_name}")
    return np.concatenate(parts, axis=-1).reshape(n, -1)


# llama.cpp's replacement where a row is not whole super-blocks of 256
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def q4_k_m_type(name: str, k: int, n_layers: int, has_output: bool) -> str:
    """The block type llama.cpp's Q4_K_M gives GGUF tensor `name` with rows of k weights: Q6_K for
    the LM head (the embedding where it is tied), and for attn_v and ffn_down in the first and
    last eighth of the layers and every third between; Q4_K elsewhere; where k is not a multiple
    of 256, Q5_0 for Q4_K and Q8_0 for Q6_K."""
    layer = re.match(r"blk\.(\d+)\.", name)
    i = int(layer.group(1)) if layer else -1
    more_bits = i < n_layers // 8 or i >= 7 * n_layers // 8 or (i - n_layers // 8) % 3 == 2
    if name == "output.weight" or (name == "token_embd.weight" and not has_output):
        t = "Q6_K"
    elif re.search(r"\.(attn_v|ffn_down)\.weight$", name) and more_bits:
        t = "Q6_K"
    else:
        t = "Q4_K"
    return t if k % QK == 0 else _FALLBACK[t]


def requantize_gguf(src: Path, dst: Path) -> dict[str, int]:
    """Write `src` to `dst` with its 2-D weights (not norms or biases) in q4_k_m_type's types, every
    metadata field copied; returns how many tensors went to each type."""
    import gguf
    from gguf.quants import dequantize, quantize as gguf_quantize

    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    n_layers = int(reader.fields[f"{arch}.block_count"].contents())
    names = {t.name for t in reader.tensors}
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    counts: dict[str, int] = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # [rows, k]
        if len(shape) != 2:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
            continue
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        name = q4_k_m_type(t.name, shape[1], n_layers, "output.weight" in names)
        qtype = gguf.GGMLQuantizationType[name]
        raw = quantize(w, name) if name.endswith("_K") else gguf_quantize(w, qtype)
        writer.add_tensor(t.name, raw, raw_dtype=qtype)
        counts[name] = counts.get(name, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return counts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m engine.kquants", description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--layout", choices=["q4_k_m"], default="q4_k_m")
    args = ap.parse_args(argv)
    counts = requantize_gguf(args.src, args.dst)
    print(f"{args.dst}: " + ", ".join(f"{n} {t}" for t, n in sorted(counts.items())) + " tensors")


if __name__ == "__main__":
    main()
