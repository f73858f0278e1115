"""engine.gguf_convert: GGUF files written here from tiny random HF models, converted back."""
from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine.config import ConfigError
from engine.gguf_convert import convert_gguf_cached, unpermute_qk
from engine.tokenizer import Tokenizer
from engine.weights import CheckpointError, load_checkpoint, resolve_model
from tests.engine.factories import tiny_hf_config

Q = gguf.GGMLQuantizationType
HF_TO_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
HF_TO_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def gguf_name(hf_name: str) -> str:
    base, suffix = hf_name.rsplit(".", 1)
    if base in HF_TO_GGUF_GLOBAL:
        return f"{HF_TO_GGUF_GLOBAL[base]}.{suffix}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{HF_TO_GGUF_LAYER[rest]}.{suffix}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to q and k rows of llama models."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_vocab() -> tuple[list[str], list[int]]:
    """A byte-level BPE vocabulary: 256 byte symbols, one merge, two control tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values()) + ["he", "<|im_start|>", "<|im_end|>"]
    types = [1] * 257 + [3, 3]
    return tokens, types


def add_tiny_metadata(writer, cfg) -> None:
    """The metadata llama.cpp writes for HF config `cfg` (rope base 5000), and the tiny vocabulary."""
    tokens, types = tiny_vocab()
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(5000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["h e"])
    writer.add_bos_token_id(257)
    writer.add_eos_token_id(258)
    writer.add_chat_template(CHAT_TEMPLATE)


def write_tiny_gguf(path: Path, kind: str = "llama", qtypes: dict[str, Q] | None = None,
                    tie: bool = False, arch: str | None = None, **overrides) -> dict[str, torch.Tensor]:
    """Save a tiny random `kind` model as GGUF, the way llama.cpp would; return its state dict.

    qtypes maps a substring of HF tensor names to the type to store them in (default F32); the
    k-quants (rows of a multiple of 256: pass hidden_size and intermediate_size in `overrides`)
    are written by engine/kquants.py.
    """
    from transformers import AutoModelForCausalLM

    from engine import kquants

    torch.manual_seed(0)
    cfg = tiny_hf_config(kind, vocab_size=len(tiny_vocab()[0]), tie_word_embeddings=tie, rope_theta=5000.0,
                         **overrides)
    state = AutoModelForCausalLM.from_config(cfg).state_dict()

    writer = gguf.GGUFWriter(path, arch or kind)
    add_tiny_metadata(writer, cfg)

    for name, value in state.items():
        if tie and name == "lm_head.weight":
            continue
        w = value.numpy()
        if kind in ("llama", "mistral") and ".q_proj.weight" in name:
            w = llama_cpp_permute(w, cfg.num_attention_heads)
        elif kind in ("llama", "mistral") and ".k_proj.weight" in name:
            w = llama_cpp_permute(w, cfg.num_key_value_heads)
        qtype = next((q for key, q in (qtypes or {}).items() if key in name), Q.F32)
        if w.ndim == 1:
            qtype = Q.F32  # llama.cpp keeps norms and biases in F32
        ours = qtype.name.endswith("_K") or qtype.name.startswith("IQ4")  # gguf does not write these
        raw = kquants.quantize(w, qtype.name) if ours else gguf.quants.quantize(w, qtype)
        writer.add_tensor(gguf_name(name), raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return state


def logits(model_dir_or_model, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = model_dir_or_model
    if isinstance(model, (str, Path)):
        model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        return model(ids).logits


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4 * 8, 3)
    permuted = llama_cpp_permute(w, 4)
    assert not np.array_equal(permuted, w)
    assert torch.equal(unpermute_qk(torch.from_numpy(permuted), 4), torch.from_numpy(w))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_f32_gguf_round_trips_exactly(tmp_path, kind):
    from transformers import AutoModelForCausalLM

    state = write_tiny_gguf(tmp_path / "tiny.gguf", kind)

    folder = resolve_model(tmp_path / "tiny.gguf", cache_dir=tmp_path / "cache")
    cfg, tensors = load_checkpoint(folder, torch.float32)

    assert cfg.architecture == kind
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.rope_theta) == (4, 2, 5000.0)
    assert set(tensors) == set(state)
    for name, value in state.items():
        assert torch.equal(tensors[name], value), name
    # transformers runs the converted folder exactly as the source model.
    source = AutoModelForCausalLM.from_config(tiny_hf_config(kind, vocab_size=259, rope_theta=5000.0))
    source.load_state_dict(state)
    ids = torch.tensor([[1, 5, 200, 7, 9, 31]])
    torch.testing.assert_close(logits(folder, ids), logits(source, ids), rtol=1e-5, atol=1e-5)


# Largest error of a round trip through each type, relative to the tensor's largest value.
TOLERANCE = {Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 1e-2, Q.Q5_0: 0.07, Q.Q5_1: 0.07,
             Q.Q4_0: 0.15, Q.Q4_1: 0.15}


def test_quantized_gguf_dequantizes_within_tolerance(tmp_path):
    qtypes = {"layers.0.self_attn.q_proj": Q.Q8_0, "layers.1.self_attn.q_proj": Q.Q4_0,
              "layers.0.self_attn.k_proj": Q.Q4_1, "layers.1.self_attn.k_proj": Q.Q8_0,
              "v_proj": Q.F16, "o_proj": Q.BF16, "gate_proj": Q.Q5_0, "up_proj": Q.Q5_1,
              "down_proj": Q.Q4_0, "embed_tokens": Q.Q8_0, "lm_head": Q.Q4_1}
    state = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", qtypes)

    _, tensors = load_checkpoint(resolve_model(tmp_path / "tiny.gguf", tmp_path / "cache"), torch.float32)

    for name, value in state.items():
        qtype = next((q for key, q in qtypes.items() if key in name), Q.F32)
        if qtype == Q.F32 or value.ndim == 1:
            assert torch.equal(tensors[name], value), name
            continue
        err = (tensors[name] - value).abs().max() / value.abs().max()
        assert 0 < err <= TOLERANCE[qtype], f"{name} ({qtype.name}): relative error {err:.4f}"


def test_tied_gguf(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf", tie=True)

    folder = resolve_model(tmp_path / "tiny.gguf", tmp_path / "cache")
    cfg, tensors = load_checkpoint(folder, torch.float32)

    assert cfg.tie_word_embeddings and "lm_head.weight" not in tensors


def test_gguf_tokenizer_and_config(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")

    folder = resolve_model(tmp_path / "tiny.gguf", tmp_path / "cache")

    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["bos_token_id"], config["eos_token_id"]) == (257, 258)
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == CHAT_TEMPLATE
    assert tok_config["eos_token"] == "<|im_end|>"
    tok = Tokenizer.from_folder(folder)
    ids = tok.encode("hello <|im_end|>", add_special_tokens=False)
    assert ids[0] == 256  # the merge "h e"
    assert ids[-1] == 258
    assert tok.decode(ids, skip_special_tokens=False) == "hello <|im_end|>"
    assert 258 in tok.eos_token_ids


def test_conversion_is_cached(tmp_path):
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path)

    first = resolve_model(gguf_path, tmp_path / "cache")
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    second = resolve_model(gguf_path, tmp_path / "cache")

    assert second == first
    assert (second / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir()] == [first.name]


def test_changed_gguf_is_converted_again(tmp_path):
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path)
    first = resolve_model(gguf_path, tmp_path / "cache")

    write_tiny_gguf(gguf_path, qtypes={"mlp": Q.Q8_0})
    os.utime(gguf_path, ns=(1, 1))

    assert resolve_model(gguf_path, tmp_path / "cache") != first


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path / "env-cache"))

    folder = resolve_model(tmp_path / "tiny.gguf")

    assert folder.parent == tmp_path / "env-cache" / "gguf"


def test_concurrent_conversions_share_one_folder(tmp_path):
    gguf_path = tmp_path / "tiny.gguf"
    state = write_tiny_gguf(gguf_path)
    cache = tmp_path / "cache" / "gguf"

    with ThreadPoolExecutor(3) as pool:
        folders = list(pool.map(lambda _: convert_gguf_cached(gguf_path, cache), range(3)))

    assert len(set(folders)) == 1
    assert list(cache.iterdir()) == [folders[0]]  # no temporary folders left behind
    _, tensors = load_checkpoint(folders[0], torch.float32)
    assert torch.equal(tensors["model.norm.weight"], state["model.norm.weight"])


def test_unsupported_gguf_architecture(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf", arch="gpt2")
    with pytest.raises(ConfigError, match="'gpt2'"):
        resolve_model(tmp_path / "tiny.gguf", tmp_path / "cache")
    assert not list((tmp_path / "cache" / "gguf").iterdir())


def test_corrupt_gguf(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(CheckpointError, match="broken.gguf"):
        resolve_model(path, tmp_path / "cache")



def test_default_model_equals_transformers_gguf_loader(default_model_dir):
    """transformers' own GGUF loader (an independent dequantizer and q/k
    un-permutation) gives exactly our tensors for the packaged model. The
    generation test alone would not catch a wrong permutation: the model
    still answers short prompts with it."""
    from transformers import AutoModelForCausalLM

    from engine.weights import default_gguf_path

    gguf_path = default_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32).state_dict()

    _, tensors = load_checkpoint(default_model_dir, torch.float32)

    for name, value in tensors.items():
        assert torch.equal(value, reference[name]), name


def test_q4_k_m_layout_follows_llama_cpp():
    """engine.kquants' benchmark files take llama.cpp's Q4_K_M types: more bits for the LM head and
    for attn_v / ffn_down in the first and last eighth of the layers and every third between, and
    the legacy types where a row is not whole super-blocks of 256."""
    from engine.kquants import q4_k_m_type

    assert [q4_k_m_type(f"blk.{i}.ffn_down.weight", 1536, 30, True) for i in (0, 2, 3, 4, 5, 8, 25, 26, 29)] == \
        ["Q6_K", "Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q6_K", "Q4_K", "Q6_K", "Q6_K"]
    assert q4_k_m_type("blk.5.attn_v.weight", 576, 30, True) == "Q8_0"  # Q6_K, but 576 is not 256-divisible
    assert q4_k_m_type("blk.4.attn_q.weight", 576, 30, True) == "Q5_0"
    assert q4_k_m_type("blk.4.attn_q.weight", 2048, 30, True) == "Q4_K"
    assert q4_k_m_type("output.weight", 2048, 30, True) == "Q6_K"
    assert q4_k_m_type("token_embd.weight", 2048, 30, False) == "Q6_K"  # tied: the embedding is the LM head
    assert q4_k_m_type("token_embd.weight", 2048, 30, True) == "Q4_K"


def test_a_requantized_gguf_loads_quantized_and_answers_like_its_fp32_conversion(tmp_path):
    """`python -m engine.kquants` rewrites an F32 GGUF in the Q4_K_M mix; quantization 'gguf' keeps
    every part (q|k|v fused across Q4_K and Q6_K in the last layer) and gives the fp32 tokens."""
    import gguf as gg

    from engine.kquants import main
    from engine.llm import LLM
    from engine.sampling import SamplingParams
    from tests.engine.factories import random_prompts

    write_tiny_gguf(tmp_path / "f32.gguf", hidden_size=256, intermediate_size=512)
    main([str(tmp_path / "f32.gguf"), str(tmp_path / "q4km.gguf")])
    types = {t.name: t.tensor_type.name for t in gg.GGUFReader(tmp_path / "q4km.gguf").tensors}
    assert (types["blk.0.attn_v.weight"], types["blk.1.attn_v.weight"], types["blk.0.attn_q.weight"],
            types["output.weight"], types["blk.0.attn_norm.weight"]) == ("Q4_K", "Q6_K", "Q4_K", "Q6_K", "F32")
    kw = dict(cache_dir=tmp_path / "cache", num_kv_blocks=64)
    q = LLM(str(tmp_path / "q4km.gguf"), quantization="gguf", **kw)
    assert [L.qkv_w.fmt for L in q.core.model.layers] == ["q4_k", "q4_k+q6_k"]
    ref = LLM(str(tmp_path / "q4km.gguf"), dtype="float32", **kw)
    assert ref.tokenizer.encode("h e") == q.tokenizer.encode("h e")  # the metadata came along
    prompts = random_prompts(3, 96, [4, 20])
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in q.generate(prompts, params)] == [o.token_ids for o in ref.generate(prompts, params)]
