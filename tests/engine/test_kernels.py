"""The native bf16 CPU ops agree with the torch reference to bf16 rounding,
and the bf16 engine that uses them still answers correctly."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention import BatchMetadata, _decode_attention
from engine.kernels import NativeOps, TorchOps, cpu_has_avx512_bf16, load_native_ops

pytestmark = pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="CPU lacks AVX512-BF16")


@pytest.fixture(scope="module")
def native():
    ext = load_native_ops()
    assert ext is not None, "the kernels should build on a CPU with AVX512-BF16"
    return NativeOps(ext)


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _close(got, ref, rtol=2 ** -6, atol=2e-2):
    assert got.shape == ref.shape
    assert torch.allclose(got.float(), ref.float(), rtol=rtol, atol=atol), (got.float() - ref.float()).abs().max()


@pytest.mark.parametrize("m", [1, 3, 4, 5, 16])
@pytest.mark.parametrize("n, k", [(960, 576), (37, 64), (576, 1536)])
def test_linear(native, m, n, k):
    x, w = _rand(m, k, seed=m), _rand(n, k, seed=n)
    ref = F.linear(x.float(), w.float())  # exact products of the bf16 inputs, fp32 sums
    _close(native.linear(x, w), ref, atol=1e-3 * k ** 0.5)


@pytest.mark.parametrize("t", [1, 4, 7])
def test_add_rms_norm(native, t):
    x, d, w = _rand(t, 576, seed=1), _rand(t, 576, seed=2), _rand(576, seed=3)
    rx, rh = TorchOps.add_rms_norm(x.clone(), d, w, 1e-5)
    nx = x.clone()
    nx2, nh = native.add_rms_norm(nx, d, w, 1e-5)
    _close(nx2, rx)
    _close(nh, rh)


def test_silu_mul(native):
    gu = _rand(5, 2 * 1536, seed=4)
    _close(native.silu_mul(gu), TorchOps.silu_mul(gu))


def test_rope_in_place_on_a_strided_view(native):
    from engine.config import ModelConfig
    from engine.model import Rotary

    cfg = ModelConfig("llama", 100, 576, 1536, 1, 9, 3, 64, rope_theta=100000.0)
    rot = Rotary(cfg, 256, torch.bfloat16, "cpu")
    qkv = _rand(4, 15, 64, seed=5)  # a decode-sized batch takes the native path
    pos = torch.tensor([0, 17, 200, 255])
    ref = TorchOps.rope(rot, pos)(qkv[:, :12].clone())
    got = native.rope(rot, pos)(qkv[:, :12])
    _close(got, ref)
    _close(qkv[:, :12], ref)  # in place


def test_paged_decode_attention(native):
    num_blocks, bs, hkv, d, h = 40, 16, 3, 64, 9
    kv = _rand(num_blocks, 2, bs, hkv, d, seed=6)
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
    q = _rand(len(lens), h, d, seed=8)
    _close(native.decode_attention(q, kv, meta, d ** -0.5), _decode_attention(q, kv, meta, d ** -0.5))


def test_bf16_default_model_still_answers(default_model_dir):
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    llm = LLM(str(default_model_dir), dtype="bfloat16", num_kv_blocks=128)
    assert isinstance(llm.core.model.ops, NativeOps)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=16, temperature=0))[0]
    assert "Paris" in out.text
    assert llm.core.pool.is_fully_free()
