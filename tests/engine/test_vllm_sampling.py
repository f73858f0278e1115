"""vLLM's sampling extras on the engine: min_tokens (no EOS, stop token or stop string before it),
allowed_token_ids, bad_words, include_stop_str_in_output and skip_special_tokens; each refused by name
when bad."""
from __future__ import annotations

import pytest
import torch

from engine.guided import GuidedSpec
from engine.sampling import SamplingError, SamplingParams
from tests.engine.factories import random_prompts, save_tiny_model

VOCAB = 96
EOS = 2  # the tiny llama's


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_model(path, initializer_range=0.2)  # peaked logits: greedy choices are clear
    return path


@pytest.fixture(scope="module")
def llm(folder):
    from engine.llm import LLM

    return LLM(str(folder), dtype="float32", num_kv_blocks=256)


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 12, "temperature": 0.0, **kw})


def test_min_tokens_holds_back_the_stop_tokens(llm):
    """A stop token that ends the plain output at once cannot come before min_tokens, EOS neither."""
    prompts = random_prompts(4, VOCAB, [6, 9], seed=1)
    for prompt, plain in zip(prompts, llm.generate(prompts, greedy())):
        first = plain.token_ids[0]
        assert llm.generate([prompt], greedy(stop_token_ids=[first]))[0].token_ids == [first]
        out = llm.generate([prompt], greedy(stop_token_ids=[first], min_tokens=5))[0]
        assert len(out.token_ids) >= 5 and first not in out.token_ids[:5] and EOS not in out.token_ids[:5]
        assert out.finish_reason == ("stop" if out.token_ids[-1] in (first, EOS) else "length")
    assert llm.core.pool.is_fully_free()


def test_allowed_token_ids_is_the_argmax_among_them(llm, hf):
    prompt = random_prompts(1, VOCAB, [7], seed=2)[0]
    allowed = [5, 17, 40, 41, 90]
    out = llm.generate([prompt], greedy(allowed_token_ids=allowed, max_tokens=6, ignore_eos=True))[0]
    assert set(out.token_ids) <= set(allowed)
    ids = prompt + out.token_ids
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, len(prompt) - 1:-1]
    assert out.token_ids == [allowed[int(row[allowed].argmax())] for row in logits]
    sampled = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=1.5, seed=3, allowed_token_ids=[9, 10]))
    assert set(sampled[0].token_ids) <= {9, 10}
    assert llm.core.pool.is_fully_free()


def test_bad_words_ban_a_words_last_token_after_the_rest_of_it(llm, hf):
    """A one-token bad word is never sampled; a two-token one's second token only right after its first.
    Greedy, the output is then the argmax of what is left, as transformers' logits give it."""
    from engine.penalties import adjust_logits

    logits = torch.zeros(2, VOCAB)
    params = [greedy(bad_words_token_ids=[[5], [7, 9]])] * 2
    out = adjust_logits(logits, params, [([1], [3, 7]), ([1], [7, 3])])
    assert out[0].isinf().nonzero().flatten().tolist() == [5, 9]  # the output ends with 7: 9 is banned
    assert out[1].isinf().nonzero().flatten().tolist() == [5]
    prompt = random_prompts(1, VOCAB, [7], seed=4)[0]
    plain = llm.generate([prompt], greedy(max_tokens=8, ignore_eos=True))[0].token_ids
    banned = [[plain[0]], plain[1:3]]  # the first token, and the second after the third... as a pair
    out = llm.generate([prompt], greedy(max_tokens=8, ignore_eos=True, bad_words_token_ids=banned))[0].token_ids
    assert out[0] != plain[0]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1]
    for j, row in enumerate(logits):
        row = row.clone()
        row[plain[0]] = float("-inf")
        if j and out[j - 1] == plain[1]:
            row[plain[2]] = float("-inf")
        assert out[j] == int(row.argmax()), f"token {j}"
    assert llm.core.pool.is_fully_free()


@pytest.mark.parametrize("kw, message", [
    (dict(min_tokens=5, max_tokens=4), "min_tokens: must be an integer in [0, max_tokens=4]"),
    (dict(min_tokens=-1), "min_tokens: must be an integer in [0, max_tokens=16]"),
    (dict(allowed_token_ids=[]), "allowed_token_ids: must be a non-empty list of non-negative token ids"),
    (dict(allowed_token_ids=[3, -1]), "allowed_token_ids: must be a non-empty list"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output: must be true or false"),
    (dict(bad_words=["ok", " "]), "bad_words: must be a list of non-empty strings"),
    (dict(bad_words_token_ids=[[3], []]), "bad_words_token_ids: must be a list of non-empty lists"),
    (dict(min_tokens=2, guided=GuidedSpec("regex", "[ab]+")), "min_tokens: cannot be combined with guided decoding"),
    (dict(allowed_token_ids=[4], guided=GuidedSpec("regex", "a")), "allowed_token_ids: cannot be combined with guided"),
])
def test_bad_values_are_refused_by_name(kw, message):
    with pytest.raises(SamplingError) as e:
        SamplingParams(**kw)
    assert str(e.value).startswith(message)


def test_stop_strings_with_the_default_models_tokenizer(default_model_dir):
    """include_stop_str_in_output keeps the stop string; min_tokens lets the output run past one; a
    special token forced into the output shows as text only with skip_special_tokens false."""
    from engine.llm import LLM

    llm = LLM(str(default_model_dir), dtype="float32", num_kv_blocks=128)
    prompt = "Count: 1, 2, 3, 4, 5, 6, 7, 8"
    plain = llm.generate(prompt, greedy(max_tokens=16))[0]
    assert ", " in plain.text, plain.text
    cut = llm.generate(prompt, greedy(max_tokens=16, stop=[","]))[0]
    kept = llm.generate(prompt, greedy(max_tokens=16, stop=[","], include_stop_str_in_output=True))[0]
    assert kept.text == cut.text + "," and kept.token_ids == cut.token_ids and kept.stop_reason == ","
    late = llm.generate(prompt, greedy(max_tokens=16, stop=[","], min_tokens=4))[0]
    assert len(late.token_ids) > len(cut.token_ids) and late.text.startswith(cut.text + ",")
    assert late.finish_reason == "stop" and not late.text.endswith(",")
    end = min(llm.core.eos_token_ids)
    forced = dict(max_tokens=3, logit_bias={end: 100.0}, ignore_eos=True)
    assert llm.generate(prompt, greedy(**forced))[0].text == ""
    shown = llm.generate(prompt, greedy(**forced, skip_special_tokens=False))[0]
    assert shown.token_ids == [end] * 3 and shown.text == llm.tokenizer.decode([end], skip_special_tokens=False) * 3
    # bad_words as words: the tokenizer makes their sequences, with and without a space before
    word = plain.text.split()[1]  # a word the plain output has after its first
    assert word in plain.text.split()
    avoided = llm.generate(prompt, greedy(max_tokens=16, bad_words=[word]))[0]
    assert word not in avoided.text.split(), (word, avoided.text)
    assert llm.core.pool.is_fully_free()
