"""The native bf16 CPU ops agree with the torch reference to bf16 rounding,
and the bf16 engine that uses them still answers correctly: each test that
takes `native` (or `kernel_isa`, tests/conftest.py) runs once per kernel ISA
path (AVX512-BF16, AVX-512 without BF16, AVX2), skipping only where the CPU
lacks that ISA."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import kernels
from engine.attention import BatchMetadata, _decode_attention
from engine.kernels import NativeOps, PackedWeight, TorchOps, load_native_ops, make_ops
from tests.conftest import require_isa
from tests.engine.factories import rand_bf16


def _close(got, ref, rtol=2 ** -6, atol=2e-2):
    assert got.shape == ref.shape
    assert torch.allclose(got.float(), ref.float(), rtol=rtol, atol=atol), (got.float() - ref.float()).abs().max()


def test_packed_weight_round_trip():
    w = rand_bf16(70, 96, seed=1)  # 70 rows: two full blocks of 32 and a padded one
    p = PackedWeight.pack(w)
    assert p.data.shape == (3, 48, 32, 2) and p.shape == (70, 96)
    assert torch.equal(p.unpack(), w)
    assert not p.data[2, :, 6:].any()  # padding rows are zero
    ids = torch.tensor([0, 31, 32, 69, 5, 5])
    assert torch.equal(p.rows(ids), w[ids])  # the embedding lookup of tied weights
    with pytest.raises(ValueError, match="even"):
        PackedWeight.pack(rand_bf16(4, 33))


@pytest.mark.parametrize("n, k", [(960, 576), (37, 64), (576, 1536), (100, 96), (65, 160), (49, 608), (1, 32)])
@pytest.mark.parametrize("f32_out", [False, True])
def test_linear_packed_every_row_count(native, n, k, f32_out):
    """M = 1..49 rows (every register tile size and the splits into tiles), N not a
    multiple of the 32-column blocks, K odd multiples of 32; bf16 and fp32 (LM head) out."""
    w = PackedWeight.pack(rand_bf16(n, k, seed=n))
    xs = rand_bf16(49, k, seed=k)
    ref = F.linear(xs.float(), w.unpack().float())  # exact products of the bf16 inputs, fp32 sums
    for m in range(1, 50):
        x = xs[:m]
        got = native.logits(x, w) if f32_out else native.linear(x, w)
        assert got.dtype == (torch.float32 if f32_out else torch.bfloat16)
        if f32_out:
            _close(got, ref[:m], rtol=1e-5, atol=1e-5 * k ** 0.5)
        else:
            _close(got, ref[:m], atol=1e-3 * k ** 0.5)


@pytest.mark.parametrize("m, n, k", [(300, 96, 1536), (700, 65, 576), (130, 2000, 64), (300, 40, 14336),
                                     (1100, 33, 4096)])
def test_linear_packed_prefill_sized(native, m, n, k):
    """Many rows (prefill; the last two in several chunks of rows): same numbers as the reference."""
    w = PackedWeight.pack(rand_bf16(n, k, seed=3))
    x = rand_bf16(m, k, seed=4)
    _close(native.linear(x, w), F.linear(x.float(), w.unpack().float()), atol=1e-3 * k ** 0.5)


def test_linear_packed_rows_do_not_depend_on_the_batch(native):
    """Every row is summed in the same order whatever the batch size and the row's
    place in it, so a token's matmul output is bit-identical alone and in any batch."""
    w = PackedWeight.pack(rand_bf16(100, 576, seed=5))
    x = rand_bf16(300, 576, seed=6)
    full = native.linear(x, w)
    for lo, hi in [(0, 1), (7, 8), (3, 19), (10, 58), (0, 49), (299, 300), (13, 213)]:
        assert torch.equal(native.linear(x[lo:hi], w), full[lo:hi])
        assert torch.equal(native.logits(x[lo:hi], w), native.logits(x, w)[lo:hi])
    w = PackedWeight.pack(rand_bf16(40, 14336, seed=5))  # 144 rows per chunk of rows
    x = rand_bf16(300, 14336, seed=6)
    full = native.linear(x, w)
    for lo, hi in [(0, 1), (140, 150), (143, 300)]:
        assert torch.equal(native.linear(x[lo:hi], w), full[lo:hi])
    # One row alone (a single-stream decode step) against the same row in a batch: an odd number
    # of blocks, a partial last block, and splits of the blocks across threads
    for n in (70, 37, 225):
        w = PackedWeight.pack(rand_bf16(n, 576, seed=n))
        x = rand_bf16(20, 576, seed=9)
        full = native.ext.linear_packed(x, w.data, w.n, threads=1)
        full32 = native.ext.linear_packed(x, w.data, w.n, f32_out=True, threads=1)
        for t in (1, 2):
            for r in (0, 19):
                assert torch.equal(native.ext.linear_packed(x[r:r + 1], w.data, w.n, threads=t), full[r:r + 1])
                assert torch.equal(native.ext.linear_packed(x[r:r + 1], w.data, w.n, f32_out=True, threads=t),
                                   full32[r:r + 1])


def test_packed_rows_is_the_embedding_lookup(native):
    w = rand_bf16(70, 96, seed=1)
    p = PackedWeight.pack(w)
    ids = torch.tensor([0, 31, 32, 69, 5, 5, 64])
    assert torch.equal(native.embedding(ids, p), w[ids])
    assert torch.equal(native.embedding(ids, w), w[ids])  # a plain table: F.embedding
    assert native.embedding(ids[:0], p).shape == (0, 96)
    with pytest.raises(RuntimeError, match="out of range"):
        native.embedding(torch.tensor([70]), p)


def test_linear_packed_no_rows(native):
    w = PackedWeight.pack(rand_bf16(40, 64, seed=7))
    assert native.linear(rand_bf16(0, 64), w).shape == (0, 40)


def test_linear_packed_threads_agree(native):
    w = PackedWeight.pack(rand_bf16(333, 576, seed=7))
    x = rand_bf16(16, 576, seed=8)
    assert torch.equal(native.ext.linear_packed(x, w.data, w.n, threads=1),
                       native.ext.linear_packed(x, w.data, w.n, threads=2))


def test_linear_packed_rejects_a_mismatched_weight(native):
    w = PackedWeight.pack(rand_bf16(64, 96, seed=9))
    with pytest.raises(RuntimeError, match="packed"):
        native.ext.linear_packed(rand_bf16(2, 64), w.data, w.n)  # K 64 against a packed K of 96
    with pytest.raises(RuntimeError, match="packed"):
        native.ext.linear_packed(rand_bf16(2, 96), w.data, 65)  # 65 rows need 3 blocks


@pytest.mark.parametrize("t", [1, 4, 7])
def test_add_rms_norm(native, t):
    x, d, w = rand_bf16(t, 576, seed=1), rand_bf16(t, 576, seed=2), rand_bf16(576, seed=3)
    rx, rh = TorchOps.add_rms_norm(x.clone(), d, w, 1e-5)
    nx = x.clone()
    nx2, nh = native.add_rms_norm(nx, d, w, 1e-5)
    _close(nx2, rx)
    _close(nh, rh)


def test_silu_mul(native):
    gu = rand_bf16(5, 2 * 1536, seed=4)
    _close(native.silu_mul(gu), TorchOps.silu_mul(gu))


def test_rope_in_place_on_a_strided_view(native):
    from engine.config import ModelConfig
    from engine.model import Rotary

    cfg = ModelConfig("llama", 100, 576, 1536, 1, 9, 3, 64, rope_theta=100000.0)
    rot = Rotary(cfg, 256, torch.bfloat16, "cpu")
    qkv = rand_bf16(4, 15, 64, seed=5)  # a decode-sized batch takes the native path
    pos = torch.tensor([0, 17, 200, 255])
    ref = TorchOps.rope(rot, pos)(qkv[:, :12].clone())
    got = native.rope(rot, pos)(qkv[:, :12])
    _close(got, ref)
    _close(qkv[:, :12], ref)  # in place


def test_an_error_on_a_worker_thread_reaches_the_caller(native):
    """A kernel's work is split into chunks that every intra-op thread claims (ops.h par_for);
    an error raised in one (here rope's scalar path refusing a head of over 512, on both
    threads at once) comes back to Python as a RuntimeError that names it, and the module
    runs on afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        qk = rand_bf16(64, 16, 520, seed=8)  # 1024 heads: two chunks of 512, one per thread
        table = rand_bf16(4, 520, seed=9)
        with pytest.raises(RuntimeError, match="rope: head_dim > 512"):
            native.ext.rope_(qk, table, table, torch.zeros(64, dtype=torch.long), threads=2)
        x = rand_bf16(64, 576, seed=10)
        ref = native.ext.add_rms_norm(x.clone(), None, torch.ones(576).bfloat16(), 1e-5, threads=1)
        _close(native.ext.add_rms_norm(x.clone(), None, torch.ones(576).bfloat16(), 1e-5, threads=2), ref, 0, 0)
    finally:
        torch.set_num_threads(threads)


def test_paged_decode_attention(native):
    num_blocks, bs, hkv, d, h = 40, 16, 3, 64, 9
    kv = rand_bf16(num_blocks, 2, bs, hkv, d, seed=6)
    lens = [1, 16, 17, 150]
    tables = torch.zeros(len(lens), 10, dtype=torch.long)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(7))
    for r, n in enumerate(lens):
        nb = -(-n // bs)
        tables[r, :nb] = perm[r * 10: r * 10 + nb]
    max_nb = tables.shape[1]
    meta = BatchMetadata(None, None, num_decode=len(lens), decode_block_tables=tables,
                         decode_context_lens=torch.tensor(lens))
    meta.decode_mask = (torch.arange(max_nb * bs)[None] < torch.tensor(lens)[:, None])[:, None, None, :]
    q = rand_bf16(len(lens), h, d, seed=8)
    _close(native.decode_attention(q, kv, meta, d ** -0.5), _decode_attention(q, kv, meta, d ** -0.5))


@pytest.mark.parametrize("lens", [[150, 33, 70, 5], [1300, 33, 700, 5, 513, 512]],
                         ids=["short", "long"])
def test_paged_decode_attention_single_stream_splits_heads_with_the_same_bits(native, lens):
    """One sequence has fewer (sequence, KV head) pairs than two per thread, so
    the kernel splits its query heads across the threads instead: each head's
    output must be bit-equal to what the same sequence gets inside a batch
    (where each KV head's query group runs together), and close to torch's.
    A context over 512 tokens is attended in parts of 512 merged afterwards,
    alone or in a batch alike: the same bits either way, and torch's values."""
    num_blocks, bs, hkv, d, h = 24, 16, 3, 64, 9
    kv = rand_bf16(num_blocks, 2, bs, hkv, d, seed=16)
    width = -(-max(lens) // bs)
    tables = torch.arange(len(lens) * width).reshape(len(lens), width) % num_blocks
    q = rand_bf16(len(lens), h, d, seed=17)

    def run(rows):
        t = tables[rows]
        ls = torch.tensor([lens[r] for r in rows])
        meta = BatchMetadata(None, None, num_decode=len(rows), decode_block_tables=t, decode_context_lens=ls)
        meta.decode_mask = (torch.arange(t.shape[1] * bs)[None] < ls[:, None])[:, None, None, :]
        return native.decode_attention(q[rows], kv, meta, d ** -0.5), _decode_attention(q[rows], kv, meta,
                                                                                        d ** -0.5)

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        batch, ref_batch = run(list(range(len(lens))))
        _close(batch, ref_batch)
        for r in range(len(lens)):
            alone, ref = run([r])
            assert torch.equal(alone[0], batch[r]), f"row {r}: a single stream's heads differ from its batch's"
            _close(alone, ref)
    finally:
        torch.set_num_threads(threads)


def test_bf16_default_model_still_answers(default_model_dir, kernel_isa):
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    llm = LLM(str(default_model_dir), dtype="bfloat16", num_kv_blocks=128, kernel_isa=kernel_isa)
    assert isinstance(llm.core.model.ops, NativeOps) and llm.core.model.ops.isa == kernel_isa
    assert llm.core.model.fused is not None
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=16, temperature=0))[0]
    assert "Paris" in out.text
    assert llm.core.pool.is_fully_free()


@pytest.mark.parametrize("tied", [True, False])
def test_bf16_model_holds_its_matmul_weights_once_packed(tmp_path, tied, kernel_isa):
    """bf16 on this CPU: every matmul weight is a PackedWeight (no [N, K] copy kept);
    tied embeddings are looked up in the packed LM head, untied ones stay plain."""
    from engine.model import LlamaModel
    from engine.weights import load_checkpoint
    from tests.engine.factories import save_tiny_model

    save_tiny_model(tmp_path, "llama", tie_word_embeddings=tied)
    cfg, weights = load_checkpoint(tmp_path, torch.bfloat16)
    model = LlamaModel(cfg, weights, torch.bfloat16, max_positions=128, kernel_isa=kernel_isa)
    for L in model.layers:
        assert all(isinstance(w, PackedWeight) for w in (L.qkv_w, L.o_w, L.gate_up_w, L.down_w))
    assert torch.equal(model.layers[1].o_w.unpack(), weights["model.layers.1.self_attn.o_proj.weight"])
    assert isinstance(model.lm_head, PackedWeight)
    assert (model.embed is None) == tied
    ids = torch.tensor([0, 95, 31, 32, 7])
    assert torch.equal(model.embed_tokens(ids), weights["model.embed_tokens.weight"][ids])
    head = weights["model.embed_tokens.weight" if tied else "lm_head.weight"]
    h = rand_bf16(3, cfg.hidden_size, seed=10)
    _close(model.compute_logits(h), F.linear(h.float(), head.float()), rtol=1e-5, atol=1e-4)


# ---- choosing the ISA path ------------------------------------------------------

def test_every_isa_path_of_the_cpu_builds_and_auto_takes_the_best(kernel_isa):
    assert load_native_ops(kernel_isa).isa == kernel_isa
    best = kernels.cpu_isas()[0]
    assert make_ops(torch.bfloat16, torch.device("cpu")).isa == best
    assert make_ops(torch.bfloat16, torch.device("cpu"), isa=kernel_isa).isa == kernel_isa
    assert isinstance(make_ops(torch.bfloat16, torch.device("cpu"), isa="none"), TorchOps)
    assert isinstance(make_ops(torch.float32, torch.device("cpu"), isa=kernel_isa), TorchOps)  # bf16 only


@pytest.mark.skipif("avx2" not in kernels.cpu_isas(), reason="CPU lacks avx2")
def test_an_avx2_only_cpu_runs_the_avx2_path_and_refuses_avx512(monkeypatch):
    """What a Zen 3 (AVX2 + FMA, no AVX-512) gets: auto is avx2, and asking for
    avx512bf16 is an error naming it, never a silent fallback."""
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"}))
    assert kernels.cpu_isas() == ["avx2"]
    assert make_ops(torch.bfloat16, torch.device("cpu")).isa == "avx2"
    with pytest.raises(ValueError, match="'avx512bf16' is not available.*avx512_bf16"):
        make_ops(torch.bfloat16, torch.device("cpu"), isa="avx512bf16")
    with pytest.raises(ValueError, match="kernel_isa: must be one of"):
        make_ops(torch.bfloat16, torch.device("cpu"), isa="sse")
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"sse4_2", "avx"}))
    assert isinstance(make_ops(torch.bfloat16, torch.device("cpu")), TorchOps)


def test_kernel_isa_names_agree_with_the_engine_config():
    from engine.config import KERNEL_ISAS, ConfigError, EngineConfig

    assert KERNEL_ISAS == kernels.KERNEL_ISAS
    with pytest.raises(ConfigError, match="kernel_isa: must be one of"):
        EngineConfig(kernel_isa="avx9").validate()


def test_the_isa_paths_give_the_same_answers(native):
    """Each path against the best one on the same weights: the same matmul to
    bf16 rounding (their sums differ in the last bits, not more)."""
    best = NativeOps(load_native_ops())
    w = PackedWeight.pack(rand_bf16(960, 576, seed=11))
    x = rand_bf16(20, 576, seed=12)
    _close(native.logits(x, w), best.logits(x, w), rtol=1e-5, atol=1e-4)


# ---- the fused decode step ------------------------------------------------------

def _decode_batch(model, kv_caches, ctx_lens, block_size=16, seed=0):
    """Prefill random contexts of the given lengths (per-op path), then build
    the next decode step for all of them: (ids, positions, meta)."""
    from engine.attention import BatchMetadata, PrefillChunk

    g = torch.Generator().manual_seed(seed)
    max_nb = max(-(-(n + 1) // block_size) for n in ctx_lens)
    tables = torch.zeros(len(ctx_lens), max_nb, dtype=torch.long)
    perm = torch.randperm(kv_caches[0].shape[0] - 1, generator=g) + 1
    for r, n in enumerate(ctx_lens):  # scattered blocks, one sequence's after another's
        nb = -(-(n + 1) // block_size)
        tables[r, :nb] = perm[r * max_nb: r * max_nb + nb]
    vocab = model.cfg.vocab_size
    for r, n in enumerate(ctx_lens):
        pos = torch.arange(n)
        meta = BatchMetadata(tables[r][pos // block_size], pos % block_size)
        meta.prefills.append(PrefillChunk(0, n, n, tables[r]))
        model.forward(torch.randint(3, vocab, (n,), generator=g), pos, meta, kv_caches)
    pos = torch.tensor(ctx_lens)
    meta = BatchMetadata(tables[torch.arange(len(ctx_lens)), pos // block_size], pos % block_size,
                         num_decode=len(ctx_lens), decode_block_tables=tables, decode_context_lens=pos + 1)
    if int(pos.min()) + 1 != max_nb * block_size:
        meta.decode_mask = (torch.arange(max_nb * block_size)[None] < (pos + 1)[:, None])[:, None, None, :]
    return torch.randint(3, vocab, (len(ctx_lens),), generator=g), pos, meta


def _fused_and_per_op(model, kv_caches, ctx_lens):
    ids, pos, meta = _decode_batch(model, kv_caches, ctx_lens)
    per_op_kv = [c.clone() for c in kv_caches]
    fused = model.fused
    assert fused is not None, "bf16 on this CPU should take the fused decode path"
    got = model.forward(ids, pos, meta, kv_caches)
    model.fused = None
    try:
        ref = model.forward(ids, pos, meta, per_op_kv)
    finally:
        model.fused = fused
    return got, ref, kv_caches, per_op_kv


@pytest.mark.skipif("avx512" not in kernels.cpu_isas(), reason="CPU lacks avx512 (AVX-512 F/BW/VL and VNNI)")
def test_an_avx512_cpu_without_bf16_runs_the_avx512_path(monkeypatch):
    """What an Intel Cascade Lake or Ice Lake (AVX-512 and VNNI, no BF16) gets: auto is
    avx512, and asking for avx512bf16 is an error naming the flag it lacks. A Skylake-SP
    (AVX-512 without VNNI, which the quantized kernels' AVX-512 dot product needs) runs avx2."""
    ice_lake = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"})
    monkeypatch.setattr(kernels, "cpu_flags", lambda: ice_lake)
    assert kernels.cpu_isas() == ["avx512", "avx2"]
    assert make_ops(torch.bfloat16, torch.device("cpu")).isa == "avx512"
    with pytest.raises(ValueError, match="'avx512bf16' is not available.*avx512_bf16"):
        make_ops(torch.bfloat16, torch.device("cpu"), isa="avx512bf16")
    monkeypatch.setattr(kernels, "cpu_flags", lambda: ice_lake - {"avx512_vnni"})
    assert kernels.cpu_isas() == ["avx2"]
    with pytest.raises(ValueError, match="'avx512' is not available.*avx512_vnni"):
        make_ops(torch.bfloat16, torch.device("cpu"), isa="avx512")


def test_the_bf16_output_is_the_fp32_output_rounded_to_nearest_even(native):
    """Each path's bf16 results are its fp32 ones rounded as torch rounds them (the avx2
    and avx512 builds round in integer code; avx512bf16 with vcvtneps2bf16)."""
    for n, k in [(960, 576), (100, 96)]:
        w = PackedWeight.pack(rand_bf16(n, k, seed=n + 1))
        x = rand_bf16(70, k, seed=k + 1)
        for m in (1, 2, 7, 12, 13, 49, 70):
            assert torch.equal(native.linear(x[:m], w), native.logits(x[:m], w).bfloat16())


def test_the_widening_paths_give_the_same_bits():
    """avx512 and avx2 widen bf16 weights to fp32 and sum each output k = 0, 1, 2, ... in
    one FMA chain, whatever the vector width, the tile and the batch: the same bits for
    every row count, decode tiles, K-blocked tiles and the LM head's fp32 output alike."""
    for isa in ("avx512", "avx2"):
        require_isa(isa)
    wide, narrow = NativeOps(load_native_ops("avx512")), NativeOps(load_native_ops("avx2"))
    for n, k in [(960, 576), (37, 64), (100, 1536)]:
        w = PackedWeight.pack(rand_bf16(n, k, seed=n + 2))
        x = rand_bf16(130, k, seed=k + 2)
        for m in list(range(1, 26)) + [49, 64, 130]:
            assert torch.equal(wide.logits(x[:m], w), narrow.logits(x[:m], w)), (n, k, m)
            assert torch.equal(wide.linear(x[:m], w), narrow.linear(x[:m], w)), (n, k, m)


@pytest.mark.parametrize("ctx_lens", [[150], [1, 16, 33], [5, 17, 40, 128, 3, 64, 65, 200]])
def test_fused_decode_is_the_per_op_decode_bit_for_bit(default_model_dir, ctx_lens, kernel_isa):
    """The fused step runs the very kernels of the per-op path in the same order:
    same hidden states, same KV writes."""
    from engine.kv_cache import KVCacheSpec, allocate_kv_cache
    from engine.model import LlamaModel
    from engine.weights import load_checkpoint

    cfg, weights = load_checkpoint(default_model_dir, torch.bfloat16)
    model = LlamaModel(cfg, weights, torch.bfloat16, max_positions=512, kernel_isa=kernel_isa)
    kv = allocate_kv_cache(KVCacheSpec.for_model(cfg, 16, "bfloat16"), 160)
    got, ref, kv_f, kv_p = _fused_and_per_op(model, kv, ctx_lens)
    assert torch.equal(got, ref)
    assert all(torch.equal(a, b) for a, b in zip(kv_f, kv_p))


@pytest.mark.parametrize("kind, rows", [("llama", 16), ("qwen2", 16), ("qwen3", 16), ("llama", 64)])
def test_fused_decode_matches_the_per_op_decode_for_a_batch(tmp_path, kind, rows, kernel_isa):
    """16 decode tokens and 64, qkv bias (Qwen2), q/k norm (Qwen3), head sizes the
    vector kernels take (Qwen3: 16; AVX2 also Llama's 8) and skip (Llama's 8 on
    AVX-512): agree to bf16 rounding."""
    from engine.kv_cache import KVCacheSpec, allocate_kv_cache
    from engine.model import LlamaModel
    from engine.weights import load_checkpoint
    from tests.engine.factories import save_tiny_model

    save_tiny_model(tmp_path, kind)
    cfg, weights = load_checkpoint(tmp_path, torch.bfloat16)
    model = LlamaModel(cfg, weights, torch.bfloat16, max_positions=128, kernel_isa=kernel_isa)
    kv = allocate_kv_cache(KVCacheSpec.for_model(cfg, 16, "bfloat16"), 8 * rows + 1)
    lens = ([1, 7, 16, 17, 30, 31, 32, 33, 40, 50, 60, 64, 65, 70, 80, 99] * 4)[:rows]
    got, ref, kv_f, kv_p = _fused_and_per_op(model, kv, lens)
    _close(got, ref, atol=5e-2)
    for a, b in zip(kv_f, kv_p):
        _close(a, b, atol=5e-2)
    if kind == "llama":  # no q/k norm (torch's in the per-op path): the same kernels, any batch size
        assert torch.equal(got, ref)
