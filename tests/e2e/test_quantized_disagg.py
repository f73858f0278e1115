"""Replicas with different weight formats in one deployment, over the real local Ray: a
`gguf` prefill replica (SmolLM2's own Q4_1 + Q8_0 blocks, fp32 activations and KV) hands
its KV to a `none` fp32 decode replica, since what moves agrees (KV dtype and layout; the
fingerprint's `weights` field is carried, not compared). The gguf model computes the
function of its dequantized weights, which the fp32 checkpoint holds, so the tokens are the
fp32 engine's. `kvrelay status` names each replica's weights and kernel path."""
from __future__ import annotations

import pytest

from engine.kernels import cpu_isas
from engine.llm import LLM
from engine.sampling import SamplingParams
from tests.e2e.conftest import disagg_spec, running_cluster

MAX_TOKENS = 16
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "1, 2, 3, 4,"]


@pytest.mark.skipif(not cpu_isas(), reason="gguf weights need a native CPU kernel path (AVX2 or AVX-512 BF16)")
def test_a_gguf_prefill_hands_off_to_a_none_decode_with_the_same_kv_dtype(ray_instance, default_model_dir, capsys):
    from cluster.cli import main

    ref = LLM(str(default_model_dir), dtype="float32", num_kv_blocks=64)
    prompts = [ref.tokenizer.encode(p) for p in PROMPTS]
    want = [o.token_ids for o in ref.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                                      ignore_eos=True))]
    del ref
    spec = disagg_spec(1, 1)
    spec["prefill"]["quantization"], spec["decode"]["quantization"] = "gguf", "none"
    with running_cluster(spec) as rc:  # dtype float32: both stages hold an fp32 KV cache
        for text, p, w in zip(PROMPTS, prompts, want):
            got = rc.client.generate(token_ids=p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
            assert list(got.token_ids) == w, f"{text!r}: gguf prefill -> none decode"
        assert rc.wait_pools_free() == {rid: True for rid in rc.cluster.actors}
        status = {r.replica_id: r for r in rc.client.status().replicas}
        assert (status["prefill-0"].quantization, status["prefill-0"].kernel_isa) == ("gguf", cpu_isas()[0])
        assert status["decode-0"].quantization == "none"
        assert main(["status", "--target", rc.target]) == 0
        lines = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[2:]}
        assert lines["prefill-0"][-1] == f"gguf/{cpu_isas()[0]}"
        assert lines["decode-0"][-1] == f"none/{status['decode-0'].kernel_isa}"

