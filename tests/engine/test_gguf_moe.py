"""GGUF mixtures of experts (qwen2moe, qwen3moe, llama-arch Mixtral): files written here from tiny
random HF MoE models the way llama.cpp lays them out (each sparse layer's experts stacked in
``blk.N.ffn_{gate,up,down}_exps`` [E, ...], the router in ``ffn_gate_inp``, Qwen2-MoE's shared
expert in ``ffn_*_shexp``), converted, and run: greedy fp32 output equals transformers' on the
same (dequantized) weights."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine.gguf_convert import unpermute_qk
from engine.llm import LLM
from engine.sampling import SamplingParams
from engine.weights import CheckpointError, load_checkpoint, resolve_model
from tests.engine.factories import hf_greedy_mismatch, random_prompts, tiny_hf_config
from tests.engine.test_gguf_convert import add_tiny_metadata, gguf_name, llama_cpp_permute, tiny_vocab

Q = gguf.GGMLQuantizationType
GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
# llama.cpp's names for a sparse layer's tensors that the dense writer does not know
MOE_NAMES = {"mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
             "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
             "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}


def moe_gguf_tensors(name: str, w: np.ndarray, inter: int) -> list[tuple[str, np.ndarray]]:
    """llama.cpp's tensors for one HF (transformers 5, in-memory packed) tensor."""
    if not name.startswith("model.layers."):
        return [(gguf_name(name), w)]
    _, _, layer, rest = name.split(".", 3)
    if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]: the gate's rows, then the up projection's
        return [(f"blk.{layer}.ffn_gate_exps.weight", w[:, :inter]), (f"blk.{layer}.ffn_up_exps.weight", w[:, inter:])]
    if rest == "mlp.experts.down_proj":
        return [(f"blk.{layer}.ffn_down_exps.weight", w)]
    base = rest.rsplit(".", 1)[0]
    if base == "mlp.shared_expert_gate":  # [1, H], which llama.cpp creates as a vector
        return [(f"blk.{layer}.{MOE_NAMES[base]}.weight", w.reshape(-1))]
    if base in MOE_NAMES:
        return [(f"blk.{layer}.{MOE_NAMES[base]}.weight", w)]
    return [(gguf_name(name), w)]


def write_moe_gguf(path, kind: str, qtypes: dict[str, Q] | None = None, drop: str | None = None, **overrides):
    """A tiny random `kind` MoE saved as GGUF, without tensor `drop`; returns the transformers
    model with the weights the file holds (dequantized). qtypes maps a substring of a GGUF
    tensor name to the type to store it in (the first that matches; default F32); the routers
    (ffn_gate_inp*) and the vectors stay F32, as llama.cpp keeps them. overrides: of the HF config."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = tiny_hf_config(kind, vocab_size=len(tiny_vocab()[0]), rope_theta=5000.0, **overrides)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    writer = gguf.GGUFWriter(path, GGUF_ARCH[kind])
    add_tiny_metadata(writer, cfg)
    num_experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    writer.add_expert_count(num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    inter = cfg.intermediate_size if kind == "mixtral" else cfg.moe_intermediate_size
    if kind != "mixtral":
        writer.add_expert_feed_forward_length(inter)
    if kind == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)

    state = model.state_dict()
    for name, value in state.items():
        w = value.numpy()
        if kind == "mixtral" and ".q_proj.weight" in name:
            w = llama_cpp_permute(w, cfg.num_attention_heads)
        elif kind == "mixtral" and ".k_proj.weight" in name:
            w = llama_cpp_permute(w, cfg.num_key_value_heads)
        stored = []
        for key, part in moe_gguf_tensors(name, w, inter):
            qtype = next((q for sub, q in (qtypes or {}).items() if sub in key), Q.F32)
            if part.ndim == 1 or "ffn_gate_inp" in key:
                qtype = Q.F32
            if key != drop:
                writer.add_tensor(key, gguf.quants.quantize(part, qtype), raw_dtype=qtype)
            stored.append(gguf.quants.dequantize(gguf.quants.quantize(part, qtype), qtype))
        # the HF model gets the weights as the file holds them
        held = np.concatenate(stored, axis=1) if len(stored) > 1 else stored[0]
        held = torch.from_numpy(held.astype(np.float32)).reshape(value.shape)
        if kind == "mixtral" and (".q_proj." in name or ".k_proj." in name):
            held = unpermute_qk(held, cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads)
        state[name] = held
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.load_state_dict(state)
    return model


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(3, 259, [5, 23, 1], seed=3)


def greedy(model, prompts, **kw) -> list[list[int]]:
    with LLM(str(model), dtype="float32", num_kv_blocks=64, **kw) as llm:
        outs = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert llm.core.pool.is_fully_free()
    return outs


def assert_matches(hf, prompts, outs, what: str) -> None:
    for p, o in zip(prompts, outs):
        assert len(o) == 24
        assert hf_greedy_mismatch(hf, p, o) is None, f"{what}: diverged from transformers"


@pytest.mark.parametrize("kind", list(GGUF_ARCH))
def test_f32_moe_gguf_equals_the_hf_checkpoint(tmp_path, kind, prompts):
    """Every tensor converts back exactly (q/k un-permuted for the llama arch, the stacked
    experts split), and greedy decoding equals transformers'."""
    hf = write_moe_gguf(tmp_path / "tiny.gguf", kind)
    hf.save_pretrained(tmp_path / "hf")
    folder = resolve_model(tmp_path / "tiny.gguf", cache_dir=tmp_path / "cache")
    cfg, tensors = load_checkpoint(folder, torch.float32)
    ref_cfg, ref = load_checkpoint(tmp_path / "hf", torch.float32)
    assert cfg.architecture == kind and cfg.moe_layers == ref_cfg.moe_layers
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (4, 2, ref_cfg.norm_topk_prob)
    assert cfg.shared_expert_intermediate_size == ref_cfg.shared_expert_intermediate_size
    assert tensors.keys() == ref.keys()
    for name in ref:
        assert torch.equal(tensors[name], ref[name]), name
    assert_matches(hf, prompts, greedy(tmp_path / "tiny.gguf", prompts), f"{kind} GGUF F32")


def test_q8_0_experts_dequantized_at_load(tmp_path, prompts):
    """Q8_0 experts: the engine runs their dequantized values, as transformers does on them."""
    hf = write_moe_gguf(tmp_path / "tiny.gguf", "qwen2_moe", qtypes={"_exps.": Q.Q8_0})
    outs = greedy(tmp_path / "tiny.gguf", prompts)
    assert_matches(hf, prompts, outs, "qwen2moe GGUF Q8_0 experts")
    assert greedy(tmp_path / "tiny.gguf", prompts, tensor_parallel_size=2, enable_expert_parallel=True) == outs


def test_missing_expert_tensor_is_named(tmp_path):
    write_moe_gguf(tmp_path / "tiny.gguf", "qwen3_moe", drop="blk.0.ffn_up_exps.weight")
    with pytest.raises(CheckpointError, match=r"tensor 'blk.0.ffn_up_exps.weight' is missing"):
        resolve_model(tmp_path / "tiny.gguf", cache_dir=tmp_path / "cache")


def test_missing_shared_expert_gate_is_named(tmp_path):
    write_moe_gguf(tmp_path / "tiny.gguf", "qwen2_moe", drop="blk.1.ffn_gate_inp_shexp.weight")
    with pytest.raises(CheckpointError, match=r"tensor 'blk.1.ffn_gate_inp_shexp.weight' is missing"):
        resolve_model(tmp_path / "tiny.gguf", cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("kind", list(GGUF_ARCH))
def test_quantization_gguf_keeps_the_experts_blocks(tmp_path, kind, prompts, quant_isa):
    """quantization 'gguf': each expert's Q4_0 / Q8_0 rows are kept as stored and dequantized
    inside the kernels; the routers stay fp32. The same greedy tokens as the fp32 model of the
    dequantized weights, which is transformers' on them."""
    from engine.quant import QuantWeight

    path = tmp_path / "tiny.gguf"
    # (a block is 32 values: Qwen2-MoE's shared expert made 64 wide)
    wide = {"shared_expert_intermediate_size": 64} if kind == "qwen2_moe" else {}
    hf = write_moe_gguf(path, kind, qtypes={"ffn_down_exps": Q.Q8_0, "_exps": Q.Q4_0, "": Q.Q8_0}, **wide)
    kw = dict(cache_dir=tmp_path / "cache", num_kv_blocks=64)
    with LLM(str(path), quantization="gguf", kernel_isa=quant_isa, **kw) as llm:
        model = llm.core.model
        moe = model.moe[model.cfg.moe_layers[0]]
        assert {moe.gate_up_w[0].fmt, moe.down_w[0].fmt} == {"q4_0", "q8_0"}  # (Q4_0: signed nibbles)
        assert isinstance(model.layers[0].qkv_w, QuantWeight) and isinstance(moe.router_w, torch.Tensor)
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert llm.core.pool.is_fully_free()
    assert got == greedy(path, prompts, cache_dir=tmp_path / "cache")
    assert_matches(hf, prompts, got, f"{kind} quantization gguf")


def test_int8_experts(tmp_path, quant_isa):
    """quantization 'int8' from a safetensors MoE: the experts quantized at load, close to fp32."""
    from engine.quant import QuantWeight
    from tests.engine.factories import save_tiny_model

    save_tiny_model(tmp_path, "qwen2_moe")
    prompts = random_prompts(3, 96, [5, 23, 1], seed=3)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with LLM(str(tmp_path), quantization="int8", kernel_isa=quant_isa, num_kv_blocks=64) as llm:
        moe = llm.core.model.moe[0]
        assert all(isinstance(w, QuantWeight) for w in moe.gate_up_w + moe.down_w + [moe.shared_down_w])
        got = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(str(tmp_path), dtype="float32", num_kv_blocks=64) as llm:
        ref = [o.token_ids for o in llm.generate(prompts, params)]
    assert sum(a == b for a, b in zip(got, ref)) >= 2
