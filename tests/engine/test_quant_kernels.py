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

from engine.kernels import ISA_NAMES, QuantOps, load_native_ops
from engine.quant import QuantError, QuantRows, QuantWeight, gguf_rows, quantize_int8
from tests.conftest import require_isa

FORMATS = ("q8_0", "q4_1", "q4_0", "int8")


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
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half()
    if fmt == "q8_0":
        return QuantRows("q8_0", 8, torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8), d)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int8)
    m = -8 * d if fmt == "q4_0" else (torch.randn(n, k // 32, generator=g) * 0.1).half()
    return QuantRows("q4_1", 4, codes, d, m)


def _ref(x: torch.Tensor, w: QuantRows) -> torch.Tensor:
    return F.linear(x.double(), w.dequantize().double())


def _close(got: torch.Tensor, ref: torch.Tensor, k: int):
    """fp32 sums over k of exact products: the error grows like sqrt(k) ulps of the terms."""
    assert got.dtype == torch.float32 and got.shape == ref.shape
    tol = 1e-6 * k ** 0.5 * ref.abs().max().item() + 1e-6
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
    assert not p.scales[2, :, 6:].float().any() and not p.mins[2, :, 6:].float().any()  # padding rows are zero


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0,
                                   gguf.GGMLQuantizationType.Q4_1])
def test_gguf_blocks_read_as_gguf_dequantizes_them(qtype):
    """The row form of a GGUF tensor's raw blocks holds the values gguf's own dequantize gives."""
    w = np.random.default_rng(0).standard_normal((40, 96)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    rows = gguf_rows(raw, qtype.name, (40, 96), "t")
    want = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(40, 96))
    torch.testing.assert_close(rows.dequantize(), want, rtol=1e-6, atol=1e-7)


def test_an_unsupported_gguf_block_type_is_named():
    with pytest.raises(QuantError, match=r"blk\.0\.ffn_up.*Q6_K.*keeps Q8_0, Q4_0, Q4_1"):
        gguf_rows(np.zeros((4, 210), np.uint8), "Q6_K", (4, 256), "tensor 'blk.0.ffn_up.weight'")


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
        _close(quant_ops.linear(xs[:m], p), ref[:m], k)


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
    with pytest.raises(RuntimeError, match="bits must be 4 or 8"):
        quant_ops.ext.linear_quant(torch.randn(2, 96), p.q, p.scales, p.mins, 64, 5)
    with pytest.raises(RuntimeError, match="fp32"):
        quant_ops.ext.linear_quant(torch.randn(2, 96).bfloat16(), p.q, p.scales, p.mins, 64, 8)
    with pytest.raises(RuntimeError, match="minimums"):
        quant_ops.ext.linear_quant(torch.randn(2, 96), p.q, p.scales, p.mins.float(), 64, 8)
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
