"""Quantized matmul weights (engine/quant.py, csrc/matmul_quant.cpp): the packed
layout holds the same values, and the kernel computes the matmul of the
dequantized fp32 weights, for every format, each ISA path (`quant_isa`, once
per ISA build the CPU runs), every batch size and odd shapes."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.kernels import ISA_NAMES, QuantOps, cpu_isas, load_native_ops
from engine.gguf_blocks import IQ4_GRID, gguf_rows, held_five_bit
from engine.quant import QuantError, QuantRows, QuantWeight, quantize_int8
from tests.conftest import require_isa

# q8_0, q6_k, int8: signed bytes; q5_0, q5_1, q5_k: 5-bit codes (nibbles and a plane of fifth bits)
# with minimums; q4_k, q5_k, q5_k_bytes (held_five_bit's form) and q6_k: coded scales, as a GGUF
# stores them; mixed*: parts in several formats read as one, with fp32 scales (mixed: bytes with
# minimums per 16 k; mixed4: nibbles; mixed5: 5-bit codes; mixed6: signed bytes per 16 k); q6_k,
# mixed and mixed6 scaled per 16 k
FORMATS = ("q8_0", "q4_1", "q4_0", "int8", "q2_k", "q3_k", "q4_k", "q5_0", "q5_1", "q5_k", "q5_k_bytes", "q6_k",
           "iq4_nl", "iq4_xs", "mixed", "mixed2", "mixed4", "mixed5", "mixed6", "mixedk", "mixedk2", "mixedk4",
           "mixedk5", "mixediq")
MIXES = {"mixed": ("q4_k", "q6_k", "q8_0"),
         "mixed2": ("q2_k", "q4_1", "q4_0"),  # nibbles with fp32 scales per 16 k
         "mixedk": ("q4_k", "q4_k", "q6_k"),  # q|k|v of a llama.cpp Q4_K_M layer: coded, bytes per 16 k
         "mixedk2": ("q2_k", "q2_k", "q3_k"),  # q|k|v of a llama.cpp Q2_K layer: coded nibbles per 16 k
         "mixedk4": ("q2_k", "q4_k", "q2_k"),  # coded nibbles per 16 k
         "mixedk5": ("q4_k", "q5_k", "q4_k"),  # coded, 5-bit codes
         "mixediq": ("iq4_xs", "q4_k", "iq4_xs"),  # IQ4_XS's values as bytes, beside Q4_K: coded bytes
         "mixed4": ("q4_k", "q4_1", "q4_0"), "mixed5": ("q5_k", "q5_1", "q5_0"), "mixed6": ("q6_k", "q8_0", "q6_k")}


@pytest.fixture(scope="session", params=ISA_NAMES)
def quant_ops(request) -> QuantOps:
    """QuantOps of one ISA path this CPU runs (its kernel family counted as exercised)."""
    isa = require_isa(request.param, family="quant")
    ext = load_native_ops(isa)
    assert ext is not None and ext.isa == isa
    return QuantOps(ext)


def _rows(fmt: str, n: int, k: int, seed: int = 0) -> QuantRows:
    """A random [n, k] weight in `fmt`, codes and scales drawn directly (the whole code range)."""
    g = torch.Generator().manual_seed(seed)
    if fmt == "int8":
        return quantize_int8(torch.randn(n, k, generator=g) * 0.05)
    if fmt in MIXES:  # parts in three formats, read as one form
        a, b = max(n // 3, 1), max(2 * n // 3, 1)
        parts = [_rows(f, r, k, seed + i) for i, (f, r) in enumerate(zip(MIXES[fmt], (a, b - a, n - b)))]
        return QuantRows.cat([p for p in parts if p.shape[0]], "t")
    if fmt == "q5_k_bytes":
        return held_five_bit(_rows("q5_k", n, k, seed))
    if fmt == "iq4_nl":  # 4-bit indices into IQ4's grid, an fp16 scale per 32
        idx = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int8)
        return QuantRows(fmt, 4, idx, (torch.rand(n, k // 32, generator=g) * 0.002).half(), grid=IQ4_GRID)
    group = 16 if fmt in ("q2_k", "q3_k", "q6_k") else 32
    if fmt.endswith("_k") or fmt == "iq4_xs":  # coded: 4-, 6- or 8-bit scale (and minimum) codes, an fp16 factor
        sup = next(s for s in (256, 128, 64, 32) if k % s == 0)  # (a GGUF's is 256)
        d = (torch.rand(n, k // sup, generator=g) * 0.002 + 1e-4).half().float()
        dmin = (torch.rand(n, k // sup, generator=g) * 0.002).half().float()
        lo, hi = {"q6_k": (-128, 128), "q3_k": (-32, 32), "q2_k": (0, 16)}.get(fmt, (0, 64))
        sc = torch.randint(lo, hi, (n, k // group), generator=g, dtype=torch.int8)
        mn = torch.randint(0, hi, (n, k // group), generator=g, dtype=torch.int8)
        if fmt == "iq4_xs":  # indices, a 6-bit signed scale code per 32
            idx = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int8)
            return QuantRows(fmt, 4, idx, torch.randint(-32, 32, (n, k // 32), generator=g, dtype=torch.int8), None,
                             d, grid=IQ4_GRID)
        if fmt in ("q3_k", "q6_k"):  # signed codes: nibbles, bytes
            c, bits = (4, 4) if fmt == "q3_k" else (32, 8)
            return QuantRows(fmt, bits, torch.randint(-c, c, (n, k), generator=g, dtype=torch.int8), sc, None, d)
        bits = 5 if fmt == "q5_k" else 4
        codes = torch.randint(0, 4 if fmt == "q2_k" else 2 ** bits, (n, k), generator=g, dtype=torch.int8)
        return QuantRows(fmt, bits, codes, sc, mn, d, -dmin)
    d = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).half()
    m = torch.randn(n, k // 32, generator=g) * 0.1
    if fmt == "q8_0":
        return QuantRows(fmt, 8, torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8), d)
    if fmt in ("q5_0", "q5_1"):
        codes = torch.randint(0, 32, (n, k), generator=g, dtype=torch.int8)
        return QuantRows(fmt, 5, codes, d, -16 * d if fmt == "q5_0" else m.to(d.dtype))
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int8)
    if fmt == "q4_0":  # signed nibbles
        return QuantRows(fmt, 4, codes - 8, d)
    return QuantRows("q4_1", 4, codes, d, m.to(d.dtype))


def _ref(x: torch.Tensor, w: QuantRows) -> torch.Tensor:
    return F.linear(x.double(), w.dequantize().double())


def _close(got: torch.Tensor, ref: torch.Tensor, k: int, scale: float | None = None):
    """fp32 sums over k of exact products: the error grows like sqrt(k) ulps of the terms, whose
    size `scale` stands for (by default the largest output: pass a whole batch's where `ref` is a
    few of its rows, whose own outputs may have cancelled)."""
    assert got.dtype == torch.float32 and got.shape == ref.shape
    tol = 1e-6 * k ** 0.5 * (ref.abs().max().item() if scale is None else scale) + 1e-6
    err = (got.double() - ref).abs().max().item()
    assert err <= tol, (err, tol)


@pytest.mark.parametrize("fmt", FORMATS)
def test_packing_keeps_every_value(fmt):
    """70 rows (two full blocks of 32 and a padded one): the packed weight's values, and
    its rows (the embedding lookup of a tied LM head), are the row form's."""
    w = _rows(fmt, 70, 96, seed=1)
    p = QuantWeight.pack(w)
    assert p.shape == (70, 96) and p.q.shape == (3, 96 * w.bits // 32, 32)
    # the same values (signed bytes are held + 128, the offset in the minimum: the last bit may differ)
    torch.testing.assert_close(p.dequantize(), w.dequantize(), rtol=1e-6, atol=1e-7)
    ids = torch.tensor([0, 31, 32, 69, 5, 5])
    assert torch.equal(p.rows(ids), p.dequantize()[ids])
    assert not p.scales[2, :, 6:].float().any()  # padding rows are zero
    assert (not p.mins[2, :, 6:].float().any()) if p.mins.numel() else (w.bits in (4, 8) and w.mins is None)


Q = gguf.GGMLQuantizationType


def _gguf_dequantized(raw: np.ndarray, qtype, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(n, k))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
                                   Q.IQ4_NL, Q.IQ4_XS])
def test_gguf_blocks_read_as_gguf_dequantizes_them(qtype):
    """The row form of a GGUF tensor's raw blocks holds exactly the values gguf's own dequantize
    gives: blocks quantized from weights (the k- and i-quants by engine/kquants.py), and for those
    also random bytes, every bit of their packed scales, minimums, codes and indices in play."""
    from engine import kquants

    n, k = 40, 512
    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
    ours = qtype.name.endswith("_K") or qtype.name.startswith("IQ4")  # gguf does not write these
    raws = [kquants.quantize(w, qtype.name) if ours else gguf.quants.quantize(w, qtype)]
    if ours:
        per, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = np.random.default_rng(1).integers(0, 256, (n, k // per, size), dtype=np.uint8)
        at = {"Q6_K": [size - 2], "Q3_K": [size - 2], "Q2_K": [size - 4, size - 2], "Q4_K": [0, 2],
              "Q5_K": [0, 2], "IQ4_NL": [0], "IQ4_XS": [0]}[qtype.name]  # the fp16 d (and dmin): finite
        for i, v in zip(at, (0.004, 0.002)):
            raw[..., i:i + 2] = np.frombuffer(np.float16(v).tobytes(), np.uint8)
        raws.append(raw.reshape(n, -1))
    for raw in raws:
        rows = gguf_rows(raw, qtype.name, (n, k), "t")
        assert torch.equal(rows.dequantize(), _gguf_dequantized(raw, qtype, n, k))
        assert torch.equal(QuantWeight.pack(rows).dequantize(), _gguf_dequantized(raw, qtype, n, k))
    assert rows.coded == (qtype.name.endswith("_K") or qtype.name == "IQ4_XS")  # scale codes kept as stored
    assert rows.bits == (4 if qtype.name in ("Q4_0", "Q4_1", "Q2_K", "Q3_K", "Q4_K", "IQ4_NL", "IQ4_XS")
                         else 5 if qtype.name.startswith("Q5") else 8)
    assert (rows.grid is not None) == qtype.name.startswith("IQ4")


def test_an_unsupported_gguf_block_type_is_named():
    with pytest.raises(QuantError, match=r"blk\.0\.ffn_up.*IQ2_XXS.*keeps Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, "
                                         r"Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS"):
        gguf_rows(np.zeros((4, 66), np.uint8), "IQ2_XXS", (4, 256), "tensor 'blk.0.ffn_up.weight'")
    with pytest.raises(QuantError, match=r"Q4_K rows of 96 weights are not whole blocks of 256"):
        gguf_rows(np.zeros((4, 54), np.uint8), "Q4_K", (4, 96), "t")


@pytest.mark.parametrize("fmts, form", [
    (("q4_k", "q6_k", "q8_0", "q5_1"), (8, 16, torch.float32, False)),  # llama.cpp's Q4_K_M q|k|v, and more
    (("q5_0", "q8_0"), (8, 32, torch.float16, True)),  # read alike: joined as they are
    (("q4_1", "q4_k", "q4_0"), (4, 32, torch.float32, False)),  # 4-bit codes stay 4-bit
    (("q4_1", "q4_0"), (4, 32, torch.float16, False)),  # Q4_0's signed nibbles + 8, its minimum -8 x scale
    (("q6_k", "q8_0"), (8, 16, torch.float32, True)),  # signed bytes stay signed
    (("q5_0", "q5_1"), (5, 32, torch.float16, False)),  # 5-bit codes with minimums both: joined as they are
    (("q4_1", "q5_k"), (5, 32, torch.float32, False)),  # 4-bit codes are 5-bit codes
    (("q4_k", "q4_k"), (4, 32, torch.int8, False, 64)),  # one coded form: joined with their codes as stored
    (("q4_k", "q6_k"), (8, 16, torch.int8, False, 64)),  # k-quants only: their scale codes kept
    (("q5_k", "q4_k"), (5, 32, torch.int8, False, 64)),
    (("q2_k", "q4_k"), (4, 16, torch.int8, False, 64)),  # nibbles per 16 k
    (("q2_k", "q3_k"), (4, 16, torch.int8, False, 64)),  # Q3_K's signed nibbles + 8, its minimum -8 x scale
    (("q3_k", "q6_k"), (8, 16, torch.int8, False, 64)),
    (("q4_0", "q3_k"), (4, 16, torch.float32, False)),
    (("q2_k", "q4_1"), (4, 16, torch.float32, False)),
    (("iq4_xs", "q4_k"), (8, 32, torch.int8, False, 64)),  # IQ4_XS's values as bytes beside Q4_K
    (("iq4_nl", "q8_0"), (8, 32, torch.float16, True)),  # IQ4_NL's values as bytes: Q8_0's form
    (("q6_k", "q6_k"), (8, 16, torch.int8, True, 64)),
])
def test_fused_parts_in_several_formats_keep_their_values(quant_ops, fmts, form):
    """q|k|v or gate|up whose parts are stored in different formats are read in one form that holds
    every part's values exactly, as few bytes as that allows, and the kernel computes their matmul."""
    parts = [_rows(f, 8 + 4 * i, 64, i) for i, f in enumerate(fmts)]
    fused = QuantRows.cat(parts, "qkv")
    assert fused.form == form and fused.fmt == "+".join(dict.fromkeys(p.fmt for p in parts))
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    p = QuantWeight.pack(fused)
    assert torch.equal(p.dequantize(), fused.dequantize())
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    _close(quant_ops.linear(x, p), _ref(x, fused), 64)


# bits a weight each coded form reads (codes, scale and minimum codes, fp32 factors per 256 k)
CODED_BITS = {"q4_k": 4 + 16 / 32 + 64 / 256, "q5_k": 5 + 16 / 32 + 64 / 256, "q5_k_bytes": 8 + 16 / 32 + 64 / 256,
              "q6_k": 8 + 8 / 16 + 32 / 256, "q3_k": 4 + 8 / 16 + 32 / 256, "q2_k": 4 + 16 / 16 + 64 / 256,
              "iq4_xs": 4 + 8 / 32 + 32 / 256}
PLAIN_BITS = {"q4_k": 4 + 64 / 32, "q5_k": 5 + 64 / 32, "q5_k_bytes": 8 + 64 / 32, "q6_k": 8 + 32 / 16,  # fp32
              "q3_k": 4 + 32 / 16, "q2_k": 4 + 64 / 16, "iq4_xs": 4 + 32 / 32}


@pytest.mark.parametrize("fmt", CODED_BITS)
def test_coded_scales_compute_what_their_products_do(quant_ops, fmt):
    """A k-quant's scale codes and factors, multiplied in the kernel, give the same bits as the
    same weight with its scales multiplied out to fp32 beforehand (what was held before), for
    decode rows, a prefill and the embedding lookup; and they read fewer bytes: Q4_K 4.75 bits a
    weight where fp32 scales and minimums read 6, Q6_K 8.625 where they read 10, Q2_K 5.25 where
    they read 8."""
    coded = _rows(fmt, 100, 512, seed=12)
    assert coded.coded and coded.sup == 256 and not coded.decoded().coded
    pc, pf = QuantWeight.pack(coded), QuantWeight.pack(coded.decoded())
    assert pc.scales.dtype == torch.int8 and pf.scales.dtype == torch.float32
    x = torch.randn(300, 512, generator=torch.Generator().manual_seed(13))
    for m in (1, 2, 3, 7, 20, 300):
        got = quant_ops.linear(x[:m], pc)
        assert torch.equal(got, quant_ops.linear(x[:m], pf)), m
    _close(got, _ref(x, coded), 512)
    ids = torch.tensor([0, 31, 99, 64])
    assert torch.equal(quant_ops.embedding(ids, pc), pf.rows(ids)) and torch.equal(pc.rows(ids), pf.rows(ids))
    weights = 128 * 512  # 100 rows padded to 4 blocks of 32
    assert (pc.nbytes - pc.grid.nbytes) * 8 / weights == CODED_BITS[fmt]  # (an IQ4 grid: 16 bytes a matrix)
    assert (pf.nbytes - pf.grid.nbytes) * 8 / weights == PLAIN_BITS[fmt]


def test_coded_scales_without_their_factors_are_refused(quant_ops):
    p = QuantWeight.pack(_rows("q4_k", 64, 256))
    x = torch.randn(2, 256)
    with pytest.raises(RuntimeError, match="scale factors of shape"):
        quant_ops.ext.linear_quant(x, p.q, p.scales, p.mins, 64, 4)
    with pytest.raises(RuntimeError, match="minimum factors"):
        quant_ops.ext.linear_quant(x, p.q, p.scales, p.mins, 64, 4, scale_d=p.scale_d)
    with pytest.raises(RuntimeError, match="scale factors of shape .* whole groups of 32"):
        quant_ops.ext.linear_quant(x, p.q, p.scales, p.mins, 64, 4, scale_d=p.scale_d[:, :, :16].contiguous(),
                                   min_d=p.min_d)
    f = QuantWeight.pack(_rows("q4_1", 64, 256))
    with pytest.raises(RuntimeError, match="scale factors are for int8 scale codes"):
        quant_ops.ext.linear_quant(x, f.q, f.scales, f.mins, 64, 4, scale_d=p.scale_d, min_d=p.min_d)


def test_int8_is_per_row_symmetric():
    w = torch.randn(8, 64) * torch.arange(1, 9).unsqueeze(1)
    q = quantize_int8(w)
    assert q.codes.dtype == torch.int8 and q.scales.shape == (8, 1) and q.codes.abs().max() == 127
    assert ((q.dequantize() - w).abs() <= q.scales / 2 + 1e-6).all()  # within half a step of its row
    assert not quantize_int8(torch.zeros(2, 32)).dequantize().any()  # an all-zero row stays zero


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n, k", [(960, 576), (37, 64), (576, 1536), (100, 96), (65, 160), (1, 32)])
def test_linear_quant_every_row_count(quant_ops, fmt, n, k):
    """M = 1..20 rows (every register tile of both ways a block is read, and the split into
    tiles), N not a multiple of 32, K odd multiples of 32: the dequantized fp32 matmul."""
    w = _rows(fmt, n, k, seed=n + k)
    p = QuantWeight.pack(w)
    xs = torch.randn(20, k, generator=torch.Generator().manual_seed(k))
    ref = _ref(xs, w)
    for m in range(1, 21):
        _close(quant_ops.linear(xs[:m], p), ref[:m], k, scale=ref.abs().max().item())


@pytest.mark.parametrize("fmt", FORMATS)
def test_native_embedding_lookup_is_the_dequantized_rows(quant_ops, fmt):
    """The native lookup of a tied quantized LM head's rows (a decode step's embedding) gives
    exactly QuantWeight.rows' values, for rows in full and padded blocks, repeated ids and none;
    an id outside the vocabulary is refused by name, not read past the codes."""
    p = QuantWeight.pack(_rows(fmt, 70, 96, seed=11))
    ids = torch.tensor([0, 31, 32, 69, 5, 5, 40])
    assert torch.equal(quant_ops.embedding(ids, p), p.rows(ids))
    assert quant_ops.embedding(torch.tensor([], dtype=torch.long), p).shape == (0, 96)
    with pytest.raises(RuntimeError, match=r"row 70 is not in \[0, 70\)"):
        quant_ops.embedding(torch.tensor([3, 70]), p)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m, n, k", [(300, 96, 1536), (700, 65, 576), (130, 2000, 64), (1100, 33, 4096)])
def test_linear_quant_prefill_sized(quant_ops, fmt, m, n, k):
    """Many rows (prefill; the last in several chunks of rows)."""
    w = _rows(fmt, n, k, seed=3)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(4))
    _close(quant_ops.linear(x, QuantWeight.pack(w)), _ref(x, w), k)


@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_quant_rows_do_not_depend_on_the_batch(quant_ops, fmt):
    """Decode tiles (codes widened in registers) and wide tiles (the block dequantized once)
    compute the same FMAs in the same order: a row's output is bit-identical in any batch."""
    p = QuantWeight.pack(_rows(fmt, 100, 576, seed=5))
    x = torch.randn(300, 576, generator=torch.Generator().manual_seed(6))
    full = quant_ops.linear(x, p)
    for lo, hi in [(0, 1), (7, 8), (3, 6), (3, 19), (10, 58), (299, 300), (13, 213)]:
        assert torch.equal(quant_ops.linear(x[lo:hi], p), full[lo:hi])


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_isa_path_gives_the_same_bits(fmt):
    """The products are exact integers and the rest is the same fp32 arithmetic in the same
    order, so the AVX-512 (with BF16 or without) and AVX2 paths agree to the bit, decode rows
    and prefill alike."""
    isas = [i for i in ISA_NAMES if i in cpu_isas()]
    if len(isas) < 2:
        pytest.skip(f"this CPU runs one ISA path ({', '.join(isas)})")
    p = QuantWeight.pack(_rows(fmt, 100, 576, seed=9))
    x = torch.randn(70, 576, generator=torch.Generator().manual_seed(10))
    outs = {i: [QuantOps(load_native_ops(i)).linear(x[:m], p) for m in (1, 70)] for i in isas}
    for isa in isas[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[isas[0]], outs[isa])), (isas[0], isa)


def test_linear_quant_threads_agree(quant_ops):
    p = QuantWeight.pack(_rows("q4_1", 200, 576, seed=7))
    x = torch.randn(20, 576)
    for m in (1, 20):
        one = quant_ops.ext.linear_quant(x[:m], p.q, p.scales, p.mins, p.n, p.bits, threads=1)
        assert torch.equal(one, quant_ops.ext.linear_quant(x[:m], p.q, p.scales, p.mins, p.n, p.bits, threads=2))


def test_linear_quant_rejects_a_mismatched_weight(quant_ops):
    p = QuantWeight.pack(_rows("q8_0", 64, 96))
    with pytest.raises(RuntimeError, match="not a quantized"):
        quant_ops.ext.linear_quant(torch.randn(2, 64), p.q, p.scales, p.mins, 64, 8)  # K 64, weight's 96
    with pytest.raises(RuntimeError, match="bits must be 4, 5 or 8"):
        quant_ops.ext.linear_quant(torch.randn(2, 96), p.q, p.scales, p.mins, 64, 6)
    with pytest.raises(RuntimeError, match="fp32"):
        quant_ops.ext.linear_quant(torch.randn(2, 96).bfloat16(), p.q, p.scales, p.mins, 64, 8)
    p4 = QuantWeight.pack(_rows("q4_1", 64, 96))
    with pytest.raises(RuntimeError, match="minimums"):
        quant_ops.ext.linear_quant(torch.randn(2, 96), p4.q, p4.scales, p4.mins.float(), 64, 4)
    with pytest.raises(RuntimeError, match="4-bit codes without minimums are read with fp16 scales per 32 k"):
        quant_ops.ext.linear_quant(torch.randn(2, 96), p4.q, p4.scales.float(), p4.mins[:0], 64, 4)
    p5 = QuantWeight.pack(_rows("q5_1", 64, 96))
    with pytest.raises(RuntimeError, match="minimums"):  # 5-bit codes always have them
        quant_ops.ext.linear_quant(torch.randn(2, 96), p5.q, p5.scales, p5.mins[:0], 64, 5)
    six = QuantWeight.pack(_rows("q6_k", 64, 96))
    with pytest.raises(RuntimeError, match="a group of 16 k"):  # scaled per 16 k, but k not whole blocks of 32
        quant_ops.ext.linear_quant(torch.randn(2, 48), six.q[:, :12].contiguous(), six.scales[:, :3].contiguous(),
                                  six.mins, 64, 8)
    with pytest.raises(QuantError, match="multiples of 8"):
        QuantWeight.pack(QuantRows("q4_1", 4, torch.zeros(4, 36, dtype=torch.int8), torch.ones(4, 1).half(),
                                   torch.zeros(4, 1).half()))


def test_fp32_elementwise_kernels_match_torch(quant_ops):
    """The fp32 build of the kernels the quantized model runs besides its matmuls."""
    g = torch.Generator().manual_seed(8)
    x, d = (torch.randn(5, 576, generator=g) for _ in range(2))
    w = torch.randn(576, generator=g)
    x0 = x.clone()
    out = quant_ops.ext.add_rms_norm(x, d, w, 1e-5)
    torch.testing.assert_close(x, x0 + d)
    torch.testing.assert_close(out, F.rms_norm(x0 + d, (576,), w, 1e-5), rtol=1e-5, atol=1e-5)
    gu = torch.randn(3, 2 * 1536, generator=g)
    torch.testing.assert_close(quant_ops.silu_mul(gu), F.silu(gu[:, :1536]) * gu[:, 1536:], rtol=1e-5, atol=1e-6)
