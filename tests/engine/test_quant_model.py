"""Quantized models (EngineConfig.quantization): `gguf` computes the function of
its dequantized fp32 weights (greedy output equal to the fp32 model's), `int8`
stays close to fp32 (top-1 agreement and KL measured), and bad combinations
are refused with the field named."""
from __future__ import annotations

import re

import pytest
import torch

from engine.config import ConfigError, EngineConfig
from engine.llm import LLM
from engine.quant import QUANTIZATIONS, QuantWeight
from engine.sampling import SamplingParams
from engine.weights import CheckpointError, load_checkpoint
from tests.engine.test_kernels import _fused_and_per_op
from tests.engine.test_model import CHAT, RAW, smol_fp32  # noqa: F401  (the dequantized fp32 default model)

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _prompts(llm):
    tok = llm.tokenizer
    return ([tok.encode(tok.apply_chat_template(m), add_special_tokens=False) for m in CHAT]
            + [tok.encode(t) for t in RAW])


def test_gguf_default_model_equals_the_dequantized_fp32_model(smol_fp32, default_model_dir, quant_isa):  # noqa: F811
    """SmolLM2's own Q4_1 + Q8_0 blocks, dequantized inside the kernels: the same greedy
    tokens as the fp32 model of its dequantized weights (and so transformers' GGUF
    loading: tests/engine/test_model.py), 32 tokens on each of the model's prompts;
    a decode step reads ~97 MB of weights instead of bf16's 269 MB."""
    llm = LLM(str(default_model_dir), quantization="gguf", kernel_isa=quant_isa, num_kv_blocks=512)
    model = llm.core.model
    assert llm.core.dtype_name == "float32" and model.fused is not None
    assert model.ops.isa == quant_isa
    assert {L.qkv_w.fmt for L in model.layers} == {"q4_1"} and model.lm_head.fmt == "q8_0"
    mats = [getattr(L, n) for L in model.layers for n in ("qkv_w", "o_w", "gate_up_w", "down_w")]
    assert all(isinstance(w, QuantWeight) for w in mats) and model.embed is None  # tied: rows of the LM head
    step_bytes = sum(w.nbytes for w in mats) + model.lm_head.nbytes
    assert 95e6 < step_bytes < 99e6, step_bytes
    prompts = _prompts(llm)
    params = SamplingParams(max_tokens=32, **GREEDY)
    for p, got, ref in zip(prompts, llm.generate(prompts, params), smol_fp32.generate(prompts, params)):
        assert got.token_ids == ref.token_ids, llm.tokenizer.decode(p)
    assert llm.core.pool.is_fully_free()
    assert "Paris" in llm.chat(CHAT[0], SamplingParams(max_tokens=24, temperature=0))[0].text


@pytest.mark.parametrize("quantization", ["gguf", "int8"])
def test_quantized_fused_decode_is_the_per_op_decode_bit_for_bit(default_model_dir, quant_isa, quantization):
    """The fused quantized step runs the per-op path's kernels in the same order."""
    from engine.kv_cache import KVCacheSpec, allocate_kv_cache
    from engine.model import LlamaModel

    cfg, weights = load_checkpoint(default_model_dir, torch.float32, quantization=quantization)
    model = LlamaModel(cfg, weights, torch.float32, max_positions=512, kernel_isa=quant_isa,
                       quantization=quantization)
    kv = allocate_kv_cache(KVCacheSpec.for_model(cfg, 16, "float32"), 160)
    got, ref, kv_f, kv_p = _fused_and_per_op(model, kv, [1, 16, 33, 5, 17, 40, 128, 3, 64, 65])
    assert torch.equal(got, ref)
    assert all(torch.equal(a, b) for a, b in zip(kv_f, kv_p))


def _all_logits(model, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab]: one prefill of the whole sequence
    from engine.attention import BatchMetadata, PrefillChunk
    from engine.kv_cache import KVCacheSpec, allocate_kv_cache

    n, bs = len(ids), 16
    table = torch.arange(1, -(-n // bs) + 1)
    kv = allocate_kv_cache(KVCacheSpec.for_model(model.cfg, bs, "float32"), len(table) + 1)
    pos = torch.arange(n)
    meta = BatchMetadata(table[pos // bs], pos % bs)
    meta.prefills.append(PrefillChunk(0, n, n, table))
    return model.compute_logits(model.forward(torch.tensor(ids), pos, meta, kv))


def agreement(fp32_model, model, sequences: list[list[int]]) -> tuple[float, float]:
    """(top-1 agreement, mean KL(fp32 || model)) of the next-token distributions at every
    position of `sequences`."""
    agree, kl, n = 0, 0.0, 0
    for ids in sequences:
        ref, got = _all_logits(fp32_model, ids).double(), _all_logits(model, ids).double()
        agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
        lp, lq = ref.log_softmax(-1), got.log_softmax(-1)
        kl += float((lp.exp() * (lp - lq)).sum())
        n += len(ids)
    return agree / n, kl / n


def test_int8_stays_close_to_fp32(smol_fp32, default_model_dir, quant_isa):  # noqa: F811
    """int8 (per-row, made at load) against the fp32 model on the default model's prompts and
    its fp32 greedy continuations (5 sequences, ~240 positions): measured top-1 agreement
    and mean KL (BENCHMARKS.md "Quantized weights"); gguf is the fp32 function itself."""
    from engine.model import LlamaModel

    prompts = _prompts(smol_fp32)
    outs = smol_fp32.generate(prompts, SamplingParams(max_tokens=32, **GREEDY))
    sequences = [p + o.token_ids for p, o in zip(prompts, outs)]
    fp32 = smol_fp32.core.model
    cfg, weights = load_checkpoint(default_model_dir, torch.float32)
    int8 = LlamaModel(cfg, weights, torch.float32, kernel_isa=quant_isa, quantization="int8")
    assert {L.down_w.fmt for L in int8.layers} == {"int8"} and int8.lm_head.fmt == "int8"
    top1, kl = agreement(fp32, int8, sequences)
    print(f"int8 vs fp32 ({quant_isa}): top-1 agreement {top1:.4f}, mean KL {kl:.5f}")
    assert top1 >= 0.9 and kl < 0.05, (top1, kl)
    cfg, weights = load_checkpoint(default_model_dir, torch.float32, quantization="gguf")
    gguf = LlamaModel(cfg, weights, torch.float32, kernel_isa=quant_isa, quantization="gguf")
    top1, kl = agreement(fp32, gguf, sequences)
    print(f"gguf vs fp32 ({quant_isa}): top-1 agreement {top1:.4f}, mean KL {kl:.2e}")
    assert top1 == 1.0 and kl < 1e-6, (top1, kl)


def test_int8_on_a_tiny_checkpoint(tmp_path, quant_isa):
    """int8 from any checkpoint (safetensors, no GGUF), Qwen2's qkv bias included: answers
    like fp32 and holds only quantized matmul weights."""
    from tests.engine.factories import random_prompts, tiny_llm

    ref = tiny_llm(tmp_path, "qwen2")
    q = LLM(str(tmp_path), quantization="int8", kernel_isa=quant_isa, num_kv_blocks=256)
    assert q.core.model.fused is not None and isinstance(q.core.model.layers[0].qkv_w, QuantWeight)
    prompts = random_prompts(4, 96, [5, 17, 33])
    params = SamplingParams(max_tokens=8, **GREEDY)
    same = sum(a.token_ids == b.token_ids for a, b in zip(q.generate(prompts, params), ref.generate(prompts, params)))
    assert same >= 3
    assert q.core.pool.is_fully_free()


def test_gguf_on_a_safetensors_checkpoint_is_refused(tmp_path):
    from tests.engine.factories import save_tiny_model

    save_tiny_model(tmp_path)
    with pytest.raises(CheckpointError, match="quantization 'gguf' needs a GGUF checkpoint.*safetensors"):
        LLM(str(tmp_path), quantization="gguf")


def test_gguf_with_a_block_type_it_does_not_keep_names_the_tensor(tmp_path):
    import gguf

    from tests.engine.test_gguf_convert import write_tiny_gguf

    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, qtypes={"mlp.up_proj": gguf.GGMLQuantizationType.F16,
                                  "": gguf.GGMLQuantizationType.Q8_0})
    with pytest.raises(CheckpointError, match=r"tensor 'blk\.0\.ffn_up\.weight'.*stored as F16.*'int8' or 'none'"):
        LLM(str(path), quantization="gguf", cache_dir=tmp_path / "cache")


def test_a_tiny_gguf_of_each_kept_type_answers_like_its_fp32_conversion(tmp_path, quant_isa):
    """Q8_0, Q4_0 and Q4_1 tensors in one file (q|k|v all one type, as a fused matmul needs):
    the same greedy tokens as the dequantized fp32 model."""
    import gguf

    from tests.engine.factories import random_prompts
    from tests.engine.test_gguf_convert import write_tiny_gguf

    Q = gguf.GGMLQuantizationType
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, qtypes={"self_attn": Q.Q4_0, "mlp.down": Q.Q8_0, "mlp": Q.Q4_1, "": Q.Q8_0})
    kw = dict(cache_dir=tmp_path / "cache", num_kv_blocks=64)
    q = LLM(str(path), quantization="gguf", kernel_isa=quant_isa, **kw)
    L = q.core.model.layers[0]
    assert [L.qkv_w.fmt, L.o_w.fmt, L.gate_up_w.fmt, L.down_w.fmt] == ["q4_0", "q4_0", "q4_1", "q8_0"]
    padded = -(-L.qkv_w.n // 32) * 32  # rows, in blocks of 32
    assert not L.qkv_w.mins.numel() and L.qkv_w.nbytes * 8 == padded * L.qkv_w.k * 4.5  # Q4_0: 4.5 bits a weight
    ref = LLM(str(path), dtype="float32", **kw)
    prompts = random_prompts(3, 96, [4, 20])
    params = SamplingParams(max_tokens=12, **GREEDY)
    assert [o.token_ids for o in q.generate(prompts, params)] == [o.token_ids for o in ref.generate(prompts, params)]


@pytest.mark.parametrize("tie, five_bit", [(False, "widen"), (True, "widen"), (False, "keep")])
def test_a_tiny_k_quant_gguf_as_llama_cpp_mixes_them_answers_like_its_fp32_conversion(tmp_path, quant_isa, tie,
                                                                                       five_bit, monkeypatch):
    """A file laid out like llama.cpp's Q4_K_M and Q5_K_M (q and k Q4_K beside a Q6_K v, Q5_K,
    Q5_1 and Q5_0, a Q6_K down projection and LM head; tied: a Q6_K embedding read by rows):
    every part kept in its format or, where a fused matmul's parts differ, widened to one, the
    5-bit codes held as bytes or (KVRELAY_GGUF_FIVE_BIT=keep) at 5 bits; the same greedy tokens
    as the dequantized fp32 model."""
    import gguf

    from tests.engine.factories import random_prompts
    from tests.engine.test_gguf_convert import write_tiny_gguf

    Q = gguf.GGMLQuantizationType
    path = tmp_path / "m.gguf"
    qtypes = {"self_attn.v_proj": Q.Q6_K, "self_attn.o_proj": Q.Q5_K, "self_attn": Q.Q4_K, "mlp.down": Q.Q6_K,
              "mlp.gate": Q.Q5_1, "mlp.up": Q.Q5_0, "lm_head": Q.Q6_K, "embed": Q.Q6_K if tie else Q.Q8_0}
    write_tiny_gguf(path, qtypes=qtypes, tie=tie, hidden_size=256, intermediate_size=512)
    kw = dict(cache_dir=tmp_path / "cache", num_kv_blocks=64)
    monkeypatch.setenv("KVRELAY_GGUF_FIVE_BIT", five_bit)
    q = LLM(str(path), quantization="gguf", kernel_isa=quant_isa, **kw)
    m = q.core.model
    L = m.layers[0]
    assert [L.qkv_w.fmt, L.o_w.fmt, L.gate_up_w.fmt, L.down_w.fmt, m.lm_head.fmt] == \
        ["q4_k+q6_k", "q5_k", "q5_1+q5_0", "q6_k", "q6_k"]
    assert [L.o_w.bits, L.gate_up_w.bits] == ([8, 8] if five_bit == "widen" else [5, 5])
    # the k-quants' scale codes kept as stored, fused q|k|v (Q4_K beside Q6_K) included
    assert [w.scales.dtype for w in (L.qkv_w, L.o_w, L.down_w, m.lm_head)] == [torch.int8] * 4
    ref = LLM(str(path), dtype="float32", **kw)
    prompts = random_prompts(3, 96, [4, 20])
    params = SamplingParams(max_tokens=12, **GREEDY)
    assert [o.token_ids for o in q.generate(prompts, params)] == [o.token_ids for o in ref.generate(prompts, params)]


# llama.cpp's low-bit layouts: per tensor (after the first name that matches), and what each
# layer matrix is then held as: (format, bits)
LOW_BIT_LAYOUTS = {
    "q3_k_m": ({"self_attn.v_proj": "Q5_K", "self_attn.o_proj": "Q4_K", "self_attn": "Q3_K", "mlp.down": "Q5_K",
                "mlp": "Q3_K"}, [("q3_k+q5_k", 8), ("q4_k", 4), ("q3_k", 4), ("q5_k", 8)]),
    "q2_k": ({"self_attn.v_proj": "Q3_K", "self_attn.o_proj": "Q4_K", "self_attn": "Q2_K", "mlp.down": "Q3_K",
              "mlp": "Q2_K"}, [("q2_k+q3_k", 4), ("q4_k", 4), ("q2_k", 4), ("q3_k", 4)]),
    "iq4_xs": ({"mlp.down": "IQ4_NL", "": "IQ4_XS"}, [("iq4_xs", 4), ("iq4_xs", 4), ("iq4_xs", 4), ("iq4_nl", 4)]),
}


@pytest.mark.parametrize("layout", LOW_BIT_LAYOUTS)
def test_a_tiny_gguf_in_llama_cpp_low_bit_layouts_answers_like_its_fp32_conversion(tmp_path, quant_isa, layout):
    """llama.cpp's Q3_K_M (Q3_K q, k, gate and up beside Q5_K v and down, Q4_K o), Q2_K (Q2_K
    beside Q3_K v and down, a Q4_K o) and IQ4_XS (with an IQ4_NL down projection) layouts: Q2_K
    held as nibbles with its 4-bit scale and minimum codes per 16 k, Q3_K as signed nibbles with
    its 6-bit scale codes, the i-quants as nibbles indexing their grid, q|k|v fused
    keeping the scale codes; the same greedy tokens as the dequantized fp32 model."""
    import gguf

    from tests.engine.factories import random_prompts
    from tests.engine.test_gguf_convert import write_tiny_gguf

    Q = gguf.GGMLQuantizationType
    types, held = LOW_BIT_LAYOUTS[layout]
    path = tmp_path / "m.gguf"
    qtypes = {part: Q[t] for part, t in types.items() if part} | {"lm_head": Q.Q6_K, "embed": Q.Q8_0}
    qtypes[""] = Q[types.get("", "Q8_0")]
    write_tiny_gguf(path, qtypes=qtypes, hidden_size=256, intermediate_size=512)
    kw = dict(cache_dir=tmp_path / "cache", num_kv_blocks=64)
    q = LLM(str(path), quantization="gguf", kernel_isa=quant_isa, **kw)
    L = q.core.model.layers[0]
    mats = (L.qkv_w, L.o_w, L.gate_up_w, L.down_w)
    assert [(w.fmt, w.bits) for w in mats] == held
    # scale codes kept as stored, except IQ4_NL's own fp16 scales
    assert [w.scales.dtype for w in mats] == [torch.float16 if w.fmt == "iq4_nl" else torch.int8 for w in mats]
    ref = LLM(str(path), dtype="float32", **kw)
    prompts = random_prompts(3, 96, [4, 20])
    params = SamplingParams(max_tokens=12, **GREEDY)
    assert [o.token_ids for o in q.generate(prompts, params)] == [o.token_ids for o in ref.generate(prompts, params)]


def test_a_bad_five_bit_form_is_refused_by_name(tmp_path, monkeypatch):
    import gguf

    from tests.engine.test_gguf_convert import write_tiny_gguf

    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, qtypes={"": gguf.GGMLQuantizationType.Q5_0})
    monkeypatch.setenv("KVRELAY_GGUF_FIVE_BIT", "5")
    with pytest.raises(CheckpointError, match=r"KVRELAY_GGUF_FIVE_BIT='5': must be one of widen, keep"):
        LLM(str(path), quantization="gguf", cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("kw, match", [
    (dict(quantization="q4"), "quantization: must be one of"),
    (dict(quantization="int8", dtype="bfloat16"), "fp32 activations.*dtype must be 'auto' or 'float32'"),
    (dict(quantization="gguf", tensor_parallel_size=2), "not supported with tensor_parallel_size 2"),
    (dict(quantization="int8", kernel_isa="none"), "needs a native CPU kernel path"),
    (dict(quantization="int8", device="cuda"), "runs on CPU only"),
])
def test_bad_quantization_settings_are_refused(kw, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**kw).validate()


def test_quantization_names_agree_with_the_engine_config():
    from engine import config

    assert config.QUANTIZATIONS == QUANTIZATIONS


def test_bench_names_each_weight_format_and_isa_path(tmp_path, capsys, quant_isa):
    """python -m engine.bench --quantization: one column per (format, path) against one
    transformers run, each with its own memory wall."""
    import re

    from engine.bench import main, torch_capability
    from tests.engine.factories import save_tiny_model

    save_tiny_model(tmp_path / "m")
    md = tmp_path / "BENCHMARKS.md"
    assert main(["--model", str(tmp_path / "m"), "--dtype", "float32", "--prompt-len", "8", "--new-tokens", "4",
                 "--batch", "2", "--isa", quant_isa, "--quantization", "none,int8", "--write",
                 "--section", "## Quantized weights", "--benchmarks-file", str(md)]) == 0
    out = capsys.readouterr().out
    native = f"transformers (torch {torch_capability()})"
    if quant_isa == "avx2" and torch_capability() != "AVX2":  # and a baseline of torch held to AVX2
        assert (f"| metric | kvrelay float32 torch ops | kvrelay int8 avx2 | {native} | transformers (torch AVX2) "
                f"| ratio float32 torch ops (vs torch {torch_capability()}) | ratio int8 avx2 (vs torch AVX2) |") in out
    else:
        assert f"| metric | kvrelay float32 torch ops | kvrelay int8 {quant_isa} | {native} | ratio" in out
    for label in ("float32 torch ops", f"int8 {quant_isa}"):
        assert f"| part of one single-stream decode step ({label}) | ms |" in out
    assert len(re.findall(r"\| bound: [\d.]+ MB of weights read", out)) == 2
    text = md.read_text()
    assert "## Quantized weights" in text and "weights `none`, `int8` (kvrelay)" in text


def test_the_stage_spec_passes_quantization_to_the_engine():
    from pydantic import ValidationError

    from cluster.spec import StageSpec

    assert StageSpec().engine_config("auto").quantization == "none"
    assert StageSpec(quantization="gguf").engine_config("auto").quantization == "gguf"
    with pytest.raises(ValidationError, match="quantization"):
        StageSpec(quantization="q4")


def test_five_bit_bench_compares_both_forms_of_one_file(tmp_path, quant_isa, monkeypatch):
    """python -m engine.five_bit_bench: both held forms of a Q5_0 file, their bytes and tokens/s side
    by side, the same greedy tokens, written to its own section."""
    import gguf

    from engine import benchmarks_md, five_bit_bench
    from tests.engine.test_gguf_convert import write_tiny_gguf

    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, qtypes={"lm_head": gguf.GGMLQuantizationType.Q8_0, "embed": gguf.GGMLQuantizationType.Q8_0,
                                  "": gguf.GGMLQuantizationType.Q5_0})
    md = tmp_path / "BENCHMARKS.md"
    write = benchmarks_md.write_section
    monkeypatch.setattr(benchmarks_md, "write_section", lambda text: write(text, md))
    assert five_bit_bench.main(["--model", str(path), "--isa", quant_isa, "--threads", "1", "--rounds", "2",
                                "--prompt-len", "16", "--new-tokens", "8", "--write"]) == 0
    text = md.read_text()
    assert text.count(five_bit_bench.SECTION) == 1
    widen, keep = (float(x) for x in re.search(r"([\d.]+) MB held as bytes .*?, ([\d.]+) MB at 5 bits", text).groups())
    assert keep < widen  # 6.0 bits a weight against 8.5 for the Q5_0 layers
    row = re.search(rf"^\| {quant_isa} \| 1 \| ([\d.]+) \| ([\d.]+) \| .* \| \*\*([\d.]+)x\*\* \| yes \|$", text, re.M)
    assert row and all(float(g) > 0 for g in row.groups()), text


def test_kscale_bench_times_both_forms_of_the_same_weights(tmp_path, quant_isa, monkeypatch):
    """python -m engine.kscale_bench (shrunk): each type as held now and as held before gives the
    same bits, and each form reads what its layout says, in bits a weight: Q4_K 4.75 (before: 6),
    Q6_K 8.62 (10), a Q4_K_M layer (q|k|v fusing Q4_K with Q6_K) 6.31 (7.77), Q2_K 5.25 (8), Q3_K
    4.62 (6), Q4_0 4.5 (5), IQ4_NL 4.5 (8.5, as bytes), IQ4_XS 4.38 (8.38)."""
    import re

    from engine import benchmarks_md, kscale_bench

    md = tmp_path / "BENCHMARKS.md"
    write = benchmarks_md.write_section
    monkeypatch.setattr(benchmarks_md, "write_section", lambda text: write(text, md))
    assert kscale_bench.main(["--shrink", "8", "--isa", quant_isa, "--threads", "1", "--rows", "1,3", "--rounds", "2",
                              "--reps", "1", "--write"]) == 0
    text = md.read_text()
    assert text.count(kscale_bench.SECTION) == 1
    rows = re.findall(rf"^\| (\w+) \| {quant_isa} \| 1 \| [13] \| [\d.]+ \(\d+%\) \| [\d.]+ \(\d+%\) "
                      rf"\| [\d.]+ \| [\d., ]+ \| \*\*[\d.]+x\*\* \| (same bits|within \de-0[6-9]) \|$", text, re.M)
    assert [t for t, _ in rows] == [t for t in kscale_bench.TYPES for _ in range(2)], text
    # the k-quants' two forms are the same products in the same order; Q4_0's agree to fp32 rounding
    assert all((agree == "same bits") == (t != "Q4_0") for t, agree in rows), rows
    bits = {"Q4_K": ("6", "4.75"), "Q6_K": ("10", "8.62"), "Q4_K_M": ("7.77", "6.31"), "Q2_K": ("8", "5.25"),
            "Q3_K": ("6", "4.62"), "Q4_0": ("5", "4.5"), "IQ4_NL": ("8.5", "4.5"), "IQ4_XS": ("8.38", "4.38")}
    for t, (before, now) in bits.items():
        assert re.search(rf"\| {t}: MB a layer \| \| \| \| [\d.]+ \({before} bits a weight\) \| [\d.]+ \({now} bits\) \|",
                         text), (t, text)
