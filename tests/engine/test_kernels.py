"""The bf16 decode kernel agrees with torch's matmul to bf16 rounding."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import cpu_has_avx512_bf16, load_gemv, make_linear

pytestmark = pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="CPU lacks AVX512-BF16")


@pytest.mark.parametrize("m", [1, 3, 4, 5, 16, 32, 33])
@pytest.mark.parametrize("n, k", [(960, 576), (37, 64), (576, 1536)])
def test_skinny_bf16_matches_torch(m, n, k):
    assert load_gemv() is not None, "the kernel should build on a CPU with AVX512-BF16"
    g = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    ref = F.linear(x.float(), w.float())  # exact products of the bf16 inputs, fp32 sums
    got = make_linear(torch.bfloat16, torch.device("cpu"))(x, w).float()
    assert got.shape == (m, n)
    # one bf16 rounding of the result (2^-8 relative) plus fp32 summation-order noise
    assert torch.allclose(got, ref, rtol=2 ** -7, atol=1e-3 * k ** 0.5)


def test_bf16_default_model_still_answers(default_model_dir):
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    llm = LLM(str(default_model_dir), dtype="bfloat16", num_kv_blocks=128)
    assert llm.core.model.linear is not F.linear  # the kernel is in use
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=16, temperature=0))[0]
    assert "Paris" in out.text
    assert llm.core.pool.is_fully_free()
