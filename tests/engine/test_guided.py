"""Guided decoding in the engine: whatever the model (here a tiny random one
with the default model's tokenizer), the output matches the schema, regex or
choice; the grammar's state survives preemption and is rebuilt from the
tokens when a request resumes elsewhere; a grammar still compiling stalls no
other request; a spec that cannot compile is refused naming the problem."""
from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from engine.guided import GuidedError, GuidedSpec, check_spec
from engine.sampling import SamplingParams
from engine.sequence import Sequence
from tests.engine.factories import tiny_llm_with_tokenizer

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "pattern": "^[A-Za-z ]{1,8}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
PROMPTS = ["Give me a person as JSON.", "Once upon a time", "1, 2, 3,"]


def guided(spec: GuidedSpec, **kw) -> SamplingParams:
    return SamplingParams(**dict({"max_tokens": 40, "temperature": 0.0, "guided": spec}, **kw))


@pytest.fixture(scope="module")
def llm(tmp_path_factory, default_model_dir):
    llm = tiny_llm_with_tokenizer(tmp_path_factory.mktemp("tok"), default_model_dir,
                                  llm_kw={"max_num_batched_tokens": 64})
    yield llm
    llm.close()


def test_json_schema_output_validates_greedy_and_sampled(llm):
    spec = GuidedSpec.json_schema(PERSON)
    outs = llm.generate(PROMPTS, [guided(spec), guided(spec, temperature=1.0, seed=3),
                                  guided(spec, temperature=1.0, top_k=5)])
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), PERSON)
    assert llm.core.pool.is_fully_free()


def test_regex_choice_and_json_object_are_honoured(llm):
    outs = llm.generate(PROMPTS, [guided(GuidedSpec("regex", r"[a-z]{2,6}@[a-z]{2,6}\.com")),
                                  guided(GuidedSpec("choice", choices=("yes", "no", "maybe so"))),
                                  guided(GuidedSpec("json_object"), max_tokens=60)])
    assert re.fullmatch(r"[a-z]{2,6}@[a-z]{2,6}\.com", outs[0].text), outs[0].text
    assert outs[1].text in ("yes", "no", "maybe so")
    if outs[2].finish_reason == "stop":  # a random model may run long inside an object
        assert isinstance(json.loads(outs[2].text), dict)
    assert outs[2].text.startswith("{")
    assert llm.core.pool.is_fully_free()


def test_a_finished_grammar_ends_the_request_even_with_ignore_eos(llm):
    out = llm.generate(PROMPTS[0], guided(GuidedSpec("choice", choices=("yes", "no")), ignore_eos=True))[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_a_resumed_request_rebuilds_the_grammar_from_its_tokens(llm):
    """What a decode replica or a migrated request does: the sequence arrives
    with output tokens already emitted, and goes on exactly as the
    uninterrupted run did (greedy), inside the grammar."""
    spec = GuidedSpec.json_schema(PERSON)
    want = llm.generate(PROMPTS[1], guided(spec))[0]
    assert len(want.token_ids) > 4
    prompt = llm.encode(PROMPTS[1])
    for k in (1, 4):
        seq = Sequence(f"resumed-{k}", prompt, guided(spec), output_token_ids=list(want.token_ids[:k]))
        llm.core.add(seq)
        while not seq.is_finished:
            llm.core.step()
        assert seq.output_token_ids == want.token_ids
    assert llm.core.pool.is_fully_free()


def test_resumed_tokens_outside_the_grammar_end_the_request_with_the_reason(llm):
    bad = llm.encode("hello")  # not the start of a JSON object
    seq = Sequence("off-grammar", llm.encode(PROMPTS[0]), guided(GuidedSpec.json_schema(PERSON)),
                   output_token_ids=bad)
    llm.core.add(seq)
    while llm.core.has_unfinished():
        llm.core.step()
    assert seq.finish_reason == "error" and "does not match the grammar" in seq.error
    assert llm.core.pool.is_fully_free()


def test_preempted_guided_requests_keep_their_grammar(tmp_path, default_model_dir):
    """A pool too small for every sequence at once: the newest are preempted
    and recomputed, and each output is the one it has alone."""
    spec = GuidedSpec.json_schema(PERSON)
    small = tiny_llm_with_tokenizer(tmp_path, default_model_dir,
                                    llm_kw={"num_kv_blocks": 12, "block_size": 4, "max_num_batched_tokens": 64})
    try:
        alone = [small.generate(p, guided(spec))[0].token_ids for p in PROMPTS]
        batched = small.generate(PROMPTS, guided(spec))
        assert sum(o.metrics["num_preemptions"] for o in batched) > 0
        assert [o.token_ids for o in batched] == alone
        for o in batched:
            jsonschema.validate(json.loads(o.text), PERSON)
        assert small.core.pool.is_fully_free()
    finally:
        small.close()


def test_a_compiling_grammar_does_not_stall_other_requests(llm):
    """The compile runs on the grammar pool: while it is busy, an unguided
    request steps to its end; the guided one starts once its grammar is in."""
    gate = threading.Event()
    llm.core.grammars._pool.submit(gate.wait)  # the pool's one thread is busy until the gate opens
    try:
        spec = GuidedSpec.json_schema({"type": "object", "properties": {"x": {"type": "integer", "maximum": 99}},
                                       "required": ["x"], "additionalProperties": False})
        g = llm.add_request(PROMPTS[0], guided(spec))
        u = llm.add_request(PROMPTS[1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        done = {}
        while u not in done:
            for ro in llm.step():
                if ro.finished:
                    done[ro.request_id] = ro
        assert g not in done and llm.core.get(g).num_output_tokens == 0
    finally:
        gate.set()
    while g not in done:
        for ro in llm.step():
            if ro.finished:
                done[ro.request_id] = ro
    assert json.loads(done[g].text).keys() == {"x"}
    assert llm.core.pool.is_fully_free()


def test_compiled_grammars_are_cached_by_spec(llm):
    a = llm.core.grammars.compile(GuidedSpec.json_schema({"type": "array", "items": {"type": "integer"}}))
    b = llm.core.grammars.compile(GuidedSpec.json_schema('{"type": "array", "items": {"type": "integer"}}'))
    assert a is b


@pytest.mark.parametrize("spec, problem", [
    (lambda: GuidedSpec("regex", "[a-"), "regex: cannot be compiled"),
    (lambda: GuidedSpec("grammar", "root ::= undefined_rule"), "grammar: cannot be compiled"),
    (lambda: GuidedSpec.json_schema({"type": "no-such-type"}), "json: cannot be compiled"),
    (lambda: GuidedSpec.json_schema("{not json"), "json: the schema is not valid JSON"),
    (lambda: GuidedSpec("choice", choices=()), "choice: must be a non-empty list"),
])
def test_a_bad_spec_is_refused_naming_the_problem(spec, problem):
    with pytest.raises(GuidedError, match=re.escape(problem)):
        check_spec(spec())


def test_a_spec_that_fails_on_the_replica_ends_only_its_request(llm):
    """The engine compiles a spec nobody checked: that request ends with the
    error, the others are served."""
    g = llm.add_request(PROMPTS[0], guided(GuidedSpec("regex", "(unclosed")))
    u = llm.add_request(PROMPTS[1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    done = {}
    while llm.has_unfinished():
        done.update((ro.request_id, ro) for ro in llm.step() if ro.finished)
    assert done[g].finish_reason == "error" and "regex: cannot be compiled" in done[g].error
    assert len(done[u].token_ids) == 4 and done[u].finish_reason == "length"
    assert llm.core.pool.is_fully_free()


def test_the_mask_touches_only_the_guided_rows_and_bans_exactly_the_zero_bits():
    import torch

    from engine.guided import apply_bitmask

    vocab = 70  # not a multiple of 32: the last word's high bits are past the vocabulary
    logits = torch.randn(4, vocab)
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (2, 3), dtype=torch.int32)
    want = logits.clone()
    for i, row in enumerate((1, 3)):
        for t in range(vocab):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                want[row, t] = float("-inf")
    apply_bitmask(logits, bitmask, [1, 3])
    assert torch.equal(logits, want)
    full = torch.randn(2, vocab)
    want = full.masked_fill(torch.isinf(want[[1, 3]]), float("-inf"))
    apply_bitmask(full, bitmask, [0, 1])
    assert torch.equal(full, want)


def test_string_length_bounds_keep_control_characters_out(llm):
    """xgrammar's own maxLength would let a raw tab in (invalid JSON); the bounds become a pattern."""
    from engine.guided import GrammarState

    spec = GuidedSpec.json_schema({"type": "object", "required": ["s"], "additionalProperties": False,
                                   "properties": {"s": {"type": "string", "minLength": 1, "maxLength": 4}}})
    compiled = llm.core.grammars.compile(spec).result(60)
    GrammarState(compiled, llm.tokenizer.encode('{"s": "ab"}', add_special_tokens=False))
    for bad in ('{"s": "a\tb"}', '{"s": "abcde"}', '{"s": ""}'):
        with pytest.raises(GuidedError, match="does not match the grammar"):
            GrammarState(compiled, llm.tokenizer.encode(bad, add_special_tokens=False))
