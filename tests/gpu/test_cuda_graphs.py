"""Decode steps replayed from CUDA graphs give the eager engine's tokens, for
batches that pad to a bucket and block tables that widen as sequences grow.
Runs only where CUDA is available."""
from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.sampling import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,",
           "A long story about a dragon who " * 6]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_match_eager(default_model_dir, dtype):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)  # crosses block boundaries
    eager = LLM(str(default_model_dir), dtype=dtype, device="cuda", num_kv_blocks=256, enforce_eager=True)
    graphs = LLM(str(default_model_dir), dtype=dtype, device="cuda", num_kv_blocks=256)
    assert eager.core.runner.graphs is None and graphs.core.runner.graphs is not None
    want = [o.token_ids for o in eager.generate(PROMPTS, params)]
    got = [o.token_ids for o in graphs.generate(PROMPTS, params)]  # 5 rows: padded to the bucket of 8
    assert got == want
    assert graphs.core.runner.graphs.graphs, "no decode step replayed a graph"
    one = graphs.generate(PROMPTS[:1], params)[0].token_ids  # bucket 1
    assert one == want[0]
    assert graphs.core.pool.is_fully_free()
