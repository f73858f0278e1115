"""Bad input to the engine gets a clear error naming the problem, and harms
no other request. (The checkpoint loader's own errors are covered in detail
in test_weights.py; here they are checked through the LLM constructor.)"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import ConfigError
from engine.llm import LLM
from engine.sampling import SamplingError, SamplingParams
from engine.weights import CheckpointError
from tests.engine.factories import random_prompts, save_tiny_model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    save_tiny_model(folder)  # max_position_embeddings=128, vocab 96
    return folder


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32)


# ---- broken checkpoints and engine settings -------------------------------------

def _unknown_architecture(folder):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPTNeoXForCausalLM"], "gpt_neox"
    (folder / "config.json").write_text(json.dumps(cfg))


def _corrupt(folder):
    path = folder / "model.safetensors"
    path.write_bytes(b"\x00" * 8 + path.read_bytes()[8:])


def _wrong_shape(folder):
    t = load_file(folder / "model.safetensors")
    t["model.layers.0.mlp.up_proj.weight"] = torch.zeros(64, 31)
    save_file(t, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("breakage,error,match", [
    (_unknown_architecture, ConfigError, "unsupported architecture.*GPTNeoXForCausalLM"),
    (lambda f: (f / "model.safetensors").unlink(), FileNotFoundError, "model.safetensors: missing"),
    (_corrupt, CheckpointError, "model.safetensors: corrupt"),
    (_wrong_shape, CheckpointError, r"up_proj.weight' has shape \[64, 31\], expected \[64, 32\]"),
])
def test_broken_checkpoint_is_named(tmp_path, breakage, error, match):
    save_tiny_model(tmp_path)
    breakage(tmp_path)
    with pytest.raises(error, match=match):
        LLM(str(tmp_path), dtype="float32")


@pytest.mark.parametrize("kw,match", [
    ({"max_model_len": 129}, "max_model_len: 129 exceeds the model's context"),
    ({"block_size": 12}, "block_size: must be a positive power of two"),
    ({"dtype": "float8"}, "dtype: must be one of"),
    ({"num_kv_blocks": 0}, "num_kv_blocks: must be > 0"),
    ({"max_num_batched_tokens": 8}, "max_num_batched_tokens: must be >= block_size"),
])
def test_bad_engine_setting_is_named(model_dir, kw, match):
    with pytest.raises(ConfigError, match=match):
        LLM(str(model_dir), **kw)


# ---- bad requests ---------------------------------------------------------------

def _bad_params(**kw) -> SamplingParams:
    p = SamplingParams(max_tokens=4)
    for k, v in kw.items():
        setattr(p, k, v)  # bypass __post_init__: add_request must validate again
    return p


BAD_REQUESTS = {
    "too long": ([5] * 128, None, ValueError, "prompt: 128 tokens does not fit the context of 128"),
    "empty ids": ([], None, ValueError, "prompt: must not be empty"),
    "empty text": ("", None, ValueError, "prompt: must not be empty"),
    "text without tokenizer": ("hello", None, ValueError, "has no tokenizer; pass token ids"),
    "out of vocab": ([5, 96, 7], None, ValueError, "prompt_token_ids: 96 is outside the vocabulary"),
    "negative id": ([-1], None, ValueError, "prompt_token_ids: -1 is outside the vocabulary"),
    "not ints": ([5, "x"], None, TypeError, "prompt: must be a string or a list of token ids"),
    "floats": ([5.0], None, TypeError, "prompt: must be a string or a list of token ids"),
    "temperature": ([5, 6], _bad_params(temperature=-1.0), SamplingError, "temperature:"),
    "top_p": ([5, 6], _bad_params(top_p=0.0), SamplingError, "top_p:"),
    "max_tokens": ([5, 6], _bad_params(max_tokens=0), SamplingError, "max_tokens:"),
    "logprobs": ([5, 6], _bad_params(logprobs=2.5), SamplingError, "logprobs:"),
}


@pytest.mark.parametrize("name", sorted(BAD_REQUESTS))
def test_bad_request_is_named(llm, name):
    prompt, params, error, match = BAD_REQUESTS[name]
    with pytest.raises(error, match=match):
        llm.add_request(prompt, params)
    assert not llm.has_unfinished() and llm.core.pool.is_fully_free()


def test_longest_prompt_that_fits_runs_to_the_context_end(llm):
    out = llm.generate([5] * 127, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    assert llm.core.pool.is_fully_free()


def test_request_larger_than_the_kv_cache(model_dir):
    small = LLM(str(model_dir), dtype="float32", num_kv_blocks=4)
    with pytest.raises(ValueError, match="needs 6 KV blocks; the cache has 4"):
        small.add_request([5] * 80, SamplingParams(max_tokens=8))
    assert small.core.pool.is_fully_free()


def test_duplicate_request_id(llm):
    llm.add_request([5, 6, 7], GREEDY, request_id="dup")
    with pytest.raises(ValueError, match="request_id: 'dup' is already running"):
        llm.add_request([8, 9], GREEDY, request_id="dup")
    outs = []
    while llm.has_unfinished():
        outs += llm.step()
    assert outs[-1].request_id == "dup" and outs[-1].prompt_token_ids == [5, 6, 7]
    llm.add_request([8, 9], GREEDY, request_id="dup")  # finished ids may be reused
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.add_request([999], GREEDY, request_id="rejected")
    llm.add_request([8, 9], GREEDY, request_id="rejected")  # a rejected id was never taken
    while llm.has_unfinished():
        llm.step()
    assert llm.core.pool.is_fully_free()


def test_rejected_requests_harm_no_other_request(llm):
    prompts = random_prompts(4, 96, [3, 40, 17, 70], seed=21)
    reference = [llm.generate(p, GREEDY)[0].token_ids for p in prompts]
    ids = [llm.add_request(p, GREEDY) for p in prompts[:2]]
    finals = {}
    bad = iter(sorted(BAD_REQUESTS))
    step = 0
    while llm.has_unfinished():
        step += 1
        if step == 2:
            ids += [llm.add_request(p, GREEDY) for p in prompts[2:]]
        name = next(bad, None)
        if name is not None:  # one bad request between every two steps, mid-prefill and mid-decode
            prompt, params, error, _ = BAD_REQUESTS[name]
            with pytest.raises(error):
                llm.add_request(prompt, params, request_id=ids[0] if step == 3 else None)
        for ro in llm.step():
            if ro.finished:
                finals[ro.request_id] = ro.token_ids
    assert next(bad, None) is None, "the requests finished before every bad request was tried"
    assert [finals[i] for i in ids] == reference
    assert llm.core.pool.is_fully_free()


def test_generate_with_one_bad_prompt_leaves_the_engine_clean(llm):
    good = random_prompts(2, 96, [9, 30], seed=22)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([good[0], [200], good[1]], GREEDY)
    with pytest.raises(ValueError, match="params: got 1 for 2 prompts"):
        llm.generate(good, [GREEDY])
    with pytest.raises(ValueError, match="must not be empty"):
        next(llm.stream([], GREEDY))
    assert not llm.has_unfinished() and llm.core.pool.is_fully_free()
    outs = llm.generate(good, GREEDY)
    assert [o.token_ids for o in outs] == [llm.generate(p, GREEDY)[0].token_ids for p in good]
    assert llm.core.pool.is_fully_free()
