"""The offline LLM API as a user sees it: streaming, abort, stop conditions,
finish reasons and per-request metrics."""
from __future__ import annotations

import json

import pytest

from engine.llm import LLM
from engine.sampling import SamplingParams
from tests.engine.factories import tiny_llm_with_tokenizer

PROMPTS = ["The quick brown fox", "Once upon a time", "def main():", "1, 2, 3,"]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**dict({"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}, **kw))


@pytest.fixture(scope="module")
def llm(tmp_path_factory, default_model_dir):
    return tiny_llm_with_tokenizer(tmp_path_factory.mktemp("tok"), default_model_dir,
                                   llm_kw={"max_num_batched_tokens": 64})


@pytest.fixture(scope="module")
def reference(llm):
    """Greedy outputs with no stop condition but max_tokens."""
    return {p: o for p, o in zip(PROMPTS, llm.generate(PROMPTS, greedy()))}


def test_stream_deltas_add_up_to_the_final_text(llm, reference):
    for prompt in PROMPTS:
        chunks = list(llm.stream(prompt, greedy()))
        assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
        final = chunks[-1]
        assert "".join(c.delta_text for c in chunks) == final.text == reference[prompt].text
        assert [t for c in chunks for t in c.delta_token_ids] == final.token_ids == reference[prompt].token_ids
        assert len(chunks) == 24 and final.finish_reason == "length"
    assert llm.core.pool.is_fully_free()


def test_stream_with_stop_string_adds_up_too(llm, reference):
    ref = reference[PROMPTS[1]]
    stop = ref.text[len(ref.text) // 2:][:3]
    chunks = list(llm.stream(PROMPTS[1], greedy(stop=[stop])))
    assert "".join(c.delta_text for c in chunks) == chunks[-1].text == ref.text[:ref.text.index(stop)]
    assert chunks[-1].finish_reason == "stop"
    assert llm.core.pool.is_fully_free()


def test_closing_a_stream_early_aborts_it(llm):
    stream = llm.stream(PROMPTS[0], greedy(max_tokens=100))
    for _ in range(3):
        next(stream)
    assert llm.core.pool.num_used_blocks > 0
    stream.close()
    assert not llm.has_unfinished()
    assert llm.core.pool.is_fully_free()


def test_abort_mid_generation_frees_blocks_and_spares_the_others(llm, reference):
    a = llm.add_request(PROMPTS[0], greedy(max_tokens=200))
    b = llm.add_request(PROMPTS[2], greedy())
    seen = {a: [], b: []}
    for _ in range(5):
        for ro in llm.step():
            seen[ro.request_id].append(ro)
    used = llm.core.pool.num_used_blocks
    llm.abort(a)
    assert llm.core.pool.num_used_blocks < used
    while llm.has_unfinished():
        for ro in llm.step():
            assert ro.request_id != a, "an aborted request produced output"
            seen[ro.request_id].append(ro)
    assert seen[b][-1].finished and seen[b][-1].token_ids == reference[PROMPTS[2]].token_ids
    assert not seen[a][-1].finished
    llm.abort(a)  # aborting again, or an unknown id, is harmless
    llm.abort("no-such-request")
    assert llm.core.pool.is_fully_free()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_stop_string_ends_generation_before_it(llm, reference, prompt):
    ref = reference[prompt]
    text = ref.text
    stop = text[len(text) // 3:][:4]
    cut = text.index(stop)
    out = llm.generate(prompt, greedy(stop=["never-in-the-output", stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:cut]
    assert out.token_ids == ref.token_ids[:len(out.token_ids)] and len(out.token_ids) < 24
    assert llm.core.pool.is_fully_free()


def test_stop_string_completed_by_the_last_allowed_token_is_a_stop(llm, reference):
    """max_tokens and the stop string end the request on the same token: the
    text is cut at the stop string, so the reason must say "stop"."""
    ref = reference[PROMPTS[0]]
    stop = ref.text[len(ref.text) // 2:][:3]
    n = len(llm.generate(PROMPTS[0], greedy(stop=[stop]))[0].token_ids)
    out = llm.generate(PROMPTS[0], greedy(stop=[stop], max_tokens=n))[0]
    assert out.text == ref.text[:ref.text.index(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert llm.core.pool.is_fully_free()


def test_stop_token_ids(llm, reference):
    ref = reference[PROMPTS[3]].token_ids
    j = len(ref) // 2
    out = llm.generate(PROMPTS[3], greedy(stop_token_ids=[ref[j]]))[0]
    k = ref.index(ref[j])
    assert out.token_ids == ref[:k + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", ref[j])
    assert llm.core.pool.is_fully_free()


def test_max_tokens_is_length(llm, reference):
    outs = llm.generate(PROMPTS, [greedy(max_tokens=n) for n in (1, 2, 7, 24)])
    for o, n, p in zip(outs, (1, 2, 7, 24), PROMPTS):
        assert len(o.token_ids) == n and o.finish_reason == "length" and o.stop_reason is None
        assert o.token_ids == reference[p].token_ids[:n]
    assert llm.core.pool.is_fully_free()


def test_eos_stops_unless_ignored(tmp_path, default_model_dir, reference):
    """The checkpoint's eos_token_id (here: a token the greedy output emits)
    ends generation with "stop"; ignore_eos runs on to max_tokens."""
    ref = reference[PROMPTS[2]].token_ids
    eos = ref[len(ref) // 2]
    llm = tiny_llm_with_tokenizer(tmp_path, default_model_dir)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["eos_token_id"] = eos
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=256)
    stopped = llm.generate(PROMPTS[2], greedy(ignore_eos=False))[0]
    assert stopped.token_ids == ref[:ref.index(eos) + 1]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", eos)
    ignored = llm.generate(PROMPTS[2], greedy(ignore_eos=True))[0]
    assert ignored.token_ids == ref and ignored.finish_reason == "length"
    assert llm.core.pool.is_fully_free()


def test_metrics_have_timings(llm):
    outs = llm.generate(PROMPTS, greedy(max_tokens=4))
    for o in outs:
        m = o.metrics
        assert 0 <= m["queue_time"] <= m["ttft"] <= m["e2e"], m
        assert m["num_preemptions"] == 0
    streamed = list(llm.stream(PROMPTS[0], greedy(max_tokens=3)))
    assert streamed[-1].metrics["e2e"] >= streamed[-1].metrics["ttft"] > 0
    assert llm.core.pool.is_fully_free()


def test_chat_applies_the_template(llm):
    msgs = [{"role": "user", "content": "Hi"}]
    out = llm.chat(msgs, greedy(max_tokens=3))[0]
    tok = llm.tokenizer
    assert out.prompt_token_ids == tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False)
    assert tok.decode(out.prompt_token_ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert llm.core.pool.is_fully_free()
