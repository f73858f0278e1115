"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): greedy fp32 output equals transformers'
token for token, at TP=1, TP=2 and TP=2 with expert parallelism under either dispatch
(``allreduce``; ``alltoall`` on shm and on gloo); both checkpoint layouts load to the same
model; routing corner cases (idle experts, every token on the same experts, fewer tokens than
ranks); batch invariance; per-expert load; bad input named."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import ConfigError, EngineConfig
from engine.llm import LLM
from engine.sampling import SamplingParams
from engine.weights import CheckpointError, load_checkpoint
from tests.conftest import require_isa
from tests.engine.factories import hf_greedy_mismatch, random_prompts, save_tiny_model

KINDS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PACKED = {"save_original_format": False}  # transformers 5's own layout: experts.gate_up_proj [E, 2I, H]
EP2 = {"tensor_parallel_size": 2, "enable_expert_parallel": True}
# the layouts a test runs at, by id: LLM arguments
LAYOUTS = {"tp1": {}, "tp2": {"tensor_parallel_size": 2}, "ep2": EP2,
           "ep2-alltoall": dict(EP2, moe_dispatch="alltoall"),
           "ep2-alltoall-gloo": dict(EP2, moe_dispatch="alltoall", tp_backend="gloo")}


def generate(folder, prompts, params=GREEDY, **kw) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy outputs and the per-expert load [sparse layers, experts] of a fresh fp32 engine."""
    with LLM(str(folder), dtype="float32", **dict({"num_kv_blocks": 64}, **kw)) as llm:
        outs = llm.generate(prompts, params)
        assert llm.core.pool.is_fully_free()
        return [o.token_ids for o in outs], llm.core.expert_load()


def hf_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def assert_matches_transformers(folder, prompts, outs, what: str) -> None:
    hf = hf_model(folder)
    for p, o in zip(prompts, outs):
        assert len(o) >= 24
        assert hf_greedy_mismatch(hf, p, o) is None, f"{what}: diverged from transformers"


@pytest.fixture(scope="module", params=KINDS)
def moe_dir(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    save_tiny_model(folder, request.param)
    return folder


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(5, 96, [5, 23, 40, 1, 17], seed=1)


def test_config_reads_each_architecture(moe_dir):
    from engine.weights import read_config

    cfg = read_config(moe_dir)
    assert cfg.num_experts == 4 and cfg.num_experts_per_tok == 2
    # qwen3_moe's mlp_only_layers=[1] keeps layer 1 dense; Qwen2-MoE has q/k/v biases and a shared expert
    assert cfg.moe_layers == ((0,) if cfg.architecture == "qwen3_moe" else (0, 1))
    assert cfg.attention_bias == (cfg.architecture == "qwen2_moe")
    assert cfg.qk_norm == (cfg.architecture in ("qwen3_moe", "olmoe"))
    assert cfg.qk_norm_full_width == (cfg.architecture == "olmoe")
    assert cfg.norm_topk_prob == (cfg.architecture in ("mixtral", "qwen3_moe"))
    assert (cfg.shared_expert_intermediate_size > 0) == (cfg.architecture == "qwen2_moe")


def test_tp1_greedy_equals_transformers(moe_dir, prompts):
    outs, load = generate(moe_dir, prompts)
    assert_matches_transformers(moe_dir, prompts, outs, "TP=1")
    assert load.shape[1] == 4 and int(load.sum()) > 0


@pytest.mark.parametrize("layout", ["tp1", "ep2-alltoall"])
def test_expert_load_counts_every_routed_token(moe_dir, layout):
    """Each (token, expert) pair counted once: alltoall's ranks route only their slices, and the
    count exchange gives rank 0 (whose load is reported) every slice's counts."""
    prompt = random_prompts(1, 96, [9], seed=5)[0]
    with LLM(str(moe_dir), dtype="float32", num_kv_blocks=64, **LAYOUTS[layout]) as llm:
        llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        load, report = llm.core.expert_load(), llm.core.load("r0")
        assert llm.core.pool.is_fully_free()
    forwarded = len(prompt) + 6 - 1  # the last sampled token is never fed back
    assert load.sum(1).tolist() == [forwarded * 2] * load.shape[0]  # top-2, per sparse layer
    assert report.expert_load == tuple(load.sum(0).tolist())


@pytest.mark.parametrize("layout", ["tp1", "ep2-alltoall"])
def test_idle_experts_one_token_at_a_time(moe_dir, layout):
    """A one-token prompt: every step is one token on 2 of the 4 experts, so two get no token
    (and under alltoall, one token for two ranks: rank 1's slice is empty)."""
    prompt = [7]
    kw = LAYOUTS[layout]
    outs, load = generate(moe_dir, [prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), **kw)
    assert ((load == 0).sum(1) == 2).all(), load
    outs, _ = generate(moe_dir, [prompt], **kw)
    assert_matches_transformers(moe_dir, [prompt], outs, f"one token per step, {layout}")


@pytest.mark.parametrize("layout", ["tp1", "ep2-alltoall"])
def test_every_token_on_the_same_experts(tmp_path, prompts, layout):
    """A router of zeros: every logit ties, so every token goes to the same two experts (the
    ones torch.topk picks among equal values, as in the reference) and the other two get nothing
    (under alltoall, every row goes to the one rank holding both)."""
    save_tiny_model(tmp_path, "mixtral")
    hf = hf_model(tmp_path)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.gate.weight.zero_()
    hf.save_pretrained(tmp_path)
    outs, load = generate(tmp_path, prompts, **LAYOUTS[layout])
    for row in load:  # per sparse layer: two experts took every token, two none
        assert sorted(row.tolist()) == [0, 0, int(row.max()), int(row.max())] and row.max() > 0, load
    assert_matches_transformers(tmp_path, prompts, outs, f"zero router, {layout}")


@pytest.mark.parametrize("kind", KINDS)
def test_both_layouts_load_to_the_same_model(tmp_path, kind, prompts):
    """The original per-expert layout (Mixtral: block_sparse_moe.experts.{j}.w1/w2/w3; Qwen:
    mlp.experts.{j}.gate_proj ...) and the packed one transformers 5 writes when asked."""
    per_expert, packed = tmp_path / "per_expert", tmp_path / "packed"
    save_tiny_model(per_expert, kind)
    save_tiny_model(packed, kind, save_kw=PACKED)
    names = set(load_file(packed / "model.safetensors"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    original = set(load_file(per_expert / "model.safetensors"))
    assert not any(n.endswith("gate_up_proj") for n in original)
    _, a = load_checkpoint(per_expert, torch.float32)
    _, b = load_checkpoint(packed, torch.float32)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    out_a, _ = generate(per_expert, prompts[:2])
    out_b, _ = generate(packed, prompts[:2])
    assert out_a == out_b


@pytest.mark.parametrize("kind", KINDS)
def test_rank_shards_equal_across_layouts(tmp_path, kind):
    """load_shard (each rank's experts or columns) reads the same tensors from either layout."""
    from engine.parallel.sharding import ShardLayout, load_shard
    from engine.weights import read_config

    per_expert, packed = tmp_path / "per_expert", tmp_path / "packed"
    save_tiny_model(per_expert, kind)
    save_tiny_model(packed, kind, save_kw=PACKED)
    cfg = read_config(packed)
    for ep in (False, True):
        for rank in (0, 1):
            layout = ShardLayout.for_rank(cfg, rank, 2, expert_parallel=ep)
            _, a = load_shard(per_expert, layout)
            _, b = load_shard(packed, layout)
            assert a.keys() == b.keys()
            assert all(torch.equal(a[n], b[n]) for n in a)
            held = {int(n.split(".")[5]) for n in a if ".mlp.experts." in n}
            assert held == ({0, 1} if rank == 0 else {2, 3}) if ep else held == {0, 1, 2, 3}


def test_alltoall_keeps_the_shared_expert_whole_on_every_rank(tmp_path):
    """alltoall runs Qwen2-MoE's shared expert on each rank's slice of the tokens, so each rank
    holds it whole (allreduce splits its columns like a dense MLP's)."""
    from engine.parallel.sharding import ShardLayout, load_shard
    from engine.weights import read_config

    save_tiny_model(tmp_path, "qwen2_moe")
    cfg = read_config(tmp_path)
    S, H = cfg.shared_expert_intermediate_size, cfg.hidden_size
    name = "model.layers.0.mlp.shared_expert.down_proj.weight"
    for dispatch, cols in (("allreduce", S // 2), ("alltoall", S)):
        for rank in (0, 1):
            layout = ShardLayout.for_rank(cfg, rank, 2, expert_parallel=True, moe_dispatch=dispatch)
            _, w = load_shard(tmp_path, layout)
            assert tuple(w[name].shape) == (H, cols), (dispatch, rank)
            assert layout.expert_owner == (0, 0, 1, 1)


@pytest.mark.parametrize("layout", ["tp2", "ep2", "ep2-alltoall", "ep2-alltoall-gloo"])
def test_tp2_greedy_equals_tp1_and_transformers(moe_dir, layout, prompts):
    kind = moe_dir.name
    ref, ref_load = generate(moe_dir, prompts, max_num_batched_tokens=64)
    out, load = generate(moe_dir, prompts, max_num_batched_tokens=64, **LAYOUTS[layout])
    assert out == ref, f"{kind}: {layout} diverged from TP=1"
    # rank 0 routes every token (allreduce) or gets every slice's counts (alltoall): the same counts
    assert torch.equal(load, ref_load)
    assert_matches_transformers(moe_dir, prompts, out, layout)


@pytest.mark.parametrize("dispatch", ["allreduce", "alltoall"])
def test_uneven_round_robin_experts(tmp_path, prompts, dispatch):
    """3 experts on 2 ranks (2 + 1), round-robin placement, packed checkpoint: still exact
    (alltoall: a slice's rows go to the ranks in another order than the experts' ids)."""
    from engine.parallel.sharding import expert_ranks

    assert expert_ranks(3, 2) == [(0, 1), (2,)] and expert_ranks(3, 2, "round_robin") == [(0, 2), (1,)]
    save_tiny_model(tmp_path, "qwen2_moe", save_kw=PACKED, num_experts=3)
    ref, _ = generate(tmp_path, prompts)
    out, _ = generate(tmp_path, prompts, tensor_parallel_size=2, enable_expert_parallel=True,
                      expert_placement="round_robin", moe_dispatch=dispatch)
    assert out == ref
    assert_matches_transformers(tmp_path, prompts, out, f"uneven round-robin EP=2, {dispatch}")


@pytest.mark.parametrize("overrides", [dict(clip_qkv=0.5), dict(num_key_value_heads=1)],
                         ids=["clip_qkv", "kv_head_replicated"])
def test_olmoe_variants_at_tp1_and_tp2(tmp_path, prompts, overrides):
    """OLMoE's clip_qkv (q, k, v clamped after the full-width norms), and its full-width k norm
    at TP=2 over one KV head that both ranks hold (its sum of squares all-reduced twice)."""
    save_tiny_model(tmp_path, "olmoe", **overrides)
    ref, _ = generate(tmp_path, prompts)
    out, _ = generate(tmp_path, prompts, tensor_parallel_size=2)
    assert out == ref, f"OLMoE {overrides}: TP=2 diverged from TP=1"
    assert_matches_transformers(tmp_path, prompts, out, f"OLMoE {overrides}")


@pytest.mark.parametrize("numerics, layout", [
    ("float32", "tp1"), ("bfloat16-avx512bf16", "tp1"), ("bfloat16-avx2", "tp1"),
    ("float32", "ep2"), ("float32", "ep2-alltoall"), ("bfloat16-avx512bf16", "ep2-alltoall")])
def test_batch_invariant(tmp_path, numerics, layout):
    """A sequence's greedy output alone equals its output among 11 others (mixed prefill and
    decode). Under alltoall the batch decides which rank's slice a token falls in, and which
    rows meet it in an expert's matmul: neither may change its output."""
    dtype, _, isa = numerics.partition("-")
    kw = {"dtype": dtype, "kernel_isa": require_isa(isa) if isa else "auto", "num_kv_blocks": 256,
          **LAYOUTS[layout]}
    save_tiny_model(tmp_path, "qwen2_moe", max_position_embeddings=256)
    prompts = random_prompts(12, 96, [1, 120, 7, 64, 33, 2, 97, 16, 15, 17, 50, 81], seed=11)
    with LLM(str(tmp_path), **kw) as llm:
        together = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts[:4]]
        assert llm.core.pool.is_fully_free()
    assert alone == together[:4]


# ---- bad input ------------------------------------------------------------------------------
def _edit_config(folder, **fields) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(fields)
    path.write_text(json.dumps(cfg))


def test_top_k_above_num_experts_is_refused(tmp_path):
    save_tiny_model(tmp_path, "mixtral")
    _edit_config(tmp_path, num_experts_per_tok=5)
    with pytest.raises(ConfigError, match=r"num_experts_per_tok \(5\) must be <= the number of experts \(4\)"):
        LLM(str(tmp_path), dtype="float32")


@pytest.mark.parametrize("packed", [False, True], ids=["per_expert", "packed"])
def test_missing_expert_tensor_is_named(tmp_path, packed):
    save_tiny_model(tmp_path, "qwen3_moe", save_kw=PACKED if packed else None)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    gone = "model.layers.0.mlp.experts.down_proj" if packed else "model.layers.0.mlp.experts.3.down_proj.weight"
    del tensors[gone]
    save_file(tensors, path, metadata={"format": "pt"})
    named = "model.layers.0.mlp.experts.0.down_proj.weight" if packed else gone
    with pytest.raises(CheckpointError, match=f"tensor '{named}' is missing"):
        load_checkpoint(tmp_path, torch.float32)


def test_misshapen_packed_experts_are_named(tmp_path):
    save_tiny_model(tmp_path, "mixtral", save_kw=PACKED)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.1.mlp.experts.gate_up_proj"] = tensors["model.layers.1.mlp.experts.gate_up_proj"][:3]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.experts.gate_up_proj' has shape \[3, 128, 32\]"):
        load_checkpoint(tmp_path, torch.float32)


def test_parallel_settings_are_checked(tmp_path):
    from engine.parallel.sharding import ShardLayout
    from engine.weights import read_config

    save_tiny_model(tmp_path, "mixtral", num_local_experts=2, num_experts_per_tok=1)
    cfg = read_config(tmp_path)
    with pytest.raises(ConfigError, match="enable_expert_parallel: tensor_parallel_size 4 exceeds the model's 2"):
        ShardLayout.for_rank(cfg, 0, 4, expert_parallel=True)
    # alltoall sends tokens to their experts' ranks: refused where there are none to send to
    for kw in ({"tensor_parallel_size": 1}, {"tensor_parallel_size": 1, "enable_expert_parallel": True},
               {"tensor_parallel_size": 2}):
        with pytest.raises(ConfigError, match="moe_dispatch: 'alltoall' .* needs enable_expert_parallel at "
                                              "tensor_parallel_size > 1"):
            EngineConfig(moe_dispatch="alltoall", **kw).validate()
    with pytest.raises(ConfigError, match="moe_dispatch: 'alltoall' .* needs enable_expert_parallel"):
        LLM(str(tmp_path), dtype="float32", moe_dispatch="alltoall")
    with pytest.raises(ConfigError, match="moe_dispatch: must be one of"):
        LLM(str(tmp_path), dtype="float32", moe_dispatch="all-to-all")
    for tp_backend in ("shm", "gloo"):  # on every CPU backend
        EngineConfig(tensor_parallel_size=2, enable_expert_parallel=True, moe_dispatch="alltoall",
                     tp_backend=tp_backend).validate()
    with pytest.raises(ConfigError, match="expert_placement: must be one of"):
        LLM(str(tmp_path), dtype="float32", expert_placement="random")


def test_stage_spec_carries_the_expert_parallel_fields():
    """The stage spec's fields reach the stage's EngineConfig, per stage (prefill EP with
    alltoall, decode EP with allreduce; a stage without EP keeps the defaults)."""
    from cluster.spec import Spec, Stage, split_spec

    ep = {"tensor_parallel_size": 2, "enable_expert_parallel": True}
    cfg = split_spec(Spec.model_validate({"prefill": dict(ep, moe_dispatch="alltoall", expert_placement="round_robin"),
                                          "decode": dict(ep, moe_dispatch="allreduce")}))
    prefill, decode = cfg.stages[Stage.PREFILL].engine, cfg.stages[Stage.DECODE].engine
    assert (prefill.enable_expert_parallel, prefill.moe_dispatch, prefill.expert_placement) == \
        (True, "alltoall", "round_robin")
    assert (decode.enable_expert_parallel, decode.moe_dispatch, decode.expert_placement) == \
        (True, "allreduce", "contiguous")
    cfg = split_spec(Spec.model_validate({"prefill": {}, "decode": {}}))
    assert not cfg.stages[Stage.DECODE].engine.enable_expert_parallel
    assert cfg.stages[Stage.DECODE].engine.moe_dispatch == "allreduce"


@pytest.mark.parametrize("stage, message", [
    ({"tensor_parallel_size": 2, "moe_dispatch": "alltoall"},
     "moe_dispatch: 'alltoall' sends each token to the rank holding its experts"),
    ({"tensor_parallel_size": 2, "enable_expert_parallel": True, "moe_dispatch": "broadcast"},
     "prefill.moe_dispatch"),
    ({"expert_placement": "random"}, "prefill.expert_placement")])
def test_stage_spec_refuses_bad_expert_parallel_fields(stage, message):
    from cluster.spec import Spec, SpecError

    with pytest.raises(SpecError, match=message):
        Spec.model_validate({"prefill": stage, "decode": {}})
