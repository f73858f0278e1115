"""logit_bias and the penalties: each against a hand-computed adjustment of
known logits, the sampler's choice they lead to, and through the engine."""
from __future__ import annotations

import pytest
import torch

from engine.penalties import adjust_logits
from engine.sampler import Sampler
from engine.sampling import SamplingError, SamplingParams
from tests.engine.factories import tiny_llm

# 6 tokens; token 0 is the model's favourite, 1 close behind
LOGITS = torch.tensor([[4.0, 3.5, 1.0, -1.0, 0.5, -2.0]])
PROMPT, OUTPUT = [3, 5], [0, 0, 0, 2]  # token 0 three times in the output, 2 once; 3 and 5 in the prompt


def _adjusted(**kw) -> list[float]:
    return adjust_logits(LOGITS, [SamplingParams(**kw)], [(PROMPT, OUTPUT)])[0].tolist()


def _greedy(**kw) -> int:
    tokens, _ = Sampler()(LOGITS, [SamplingParams(temperature=0, **kw)], [len(OUTPUT)], [(PROMPT, OUTPUT)])
    return tokens[0]


def test_presence_penalty_subtracts_once_per_token_seen_in_the_output():
    # 0 and 2 occur in the output (however often): minus 0.6 each; prompt tokens untouched
    assert _adjusted(presence_penalty=0.6) == pytest.approx([3.4, 3.5, 0.4, -1.0, 0.5, -2.0])
    assert _greedy() == 0 and _greedy(presence_penalty=0.6) == 1


def test_frequency_penalty_subtracts_per_occurrence_in_the_output():
    # token 0: 4 - 3 * 0.3 = 3.1; token 2: 1 - 0.3 = 0.7
    assert _adjusted(frequency_penalty=0.3) == pytest.approx([3.1, 3.5, 0.7, -1.0, 0.5, -2.0])
    assert _greedy(frequency_penalty=0.3) == 1 and _greedy(frequency_penalty=0.1) == 0  # 4 - 0.3 > 3.5


def test_negative_penalties_reward_repetition():
    assert _adjusted(presence_penalty=-1.0, frequency_penalty=-0.5) == pytest.approx(
        [6.5, 3.5, 2.5, -1.0, 0.5, -2.0])


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output():
    # seen: 0, 2 (output), 3, 5 (prompt); 4.0 / 2 = 2.0, 1.0 / 2 = 0.5, -1 * 2 = -2, -2 * 2 = -4
    assert _adjusted(repetition_penalty=2.0) == pytest.approx([2.0, 3.5, 0.5, -2.0, 0.5, -4.0])
    assert _greedy(repetition_penalty=2.0) == 1
    # below 1 it favours what was seen
    assert _adjusted(repetition_penalty=0.5) == pytest.approx([8.0, 3.5, 2.0, -0.5, 0.5, -1.0])


def test_logit_bias_adds_before_the_penalties():
    assert _adjusted(logit_bias={5: 100.0, 0: -100.0}) == pytest.approx([-96.0, 3.5, 1.0, -1.0, 0.5, 98.0])
    # bias, then repetition: token 5: (-2 + 3) / 2 = 0.5
    assert _adjusted(logit_bias={5: 3.0}, repetition_penalty=2.0)[5] == pytest.approx(0.5)
    assert _greedy(logit_bias={5: 100.0}) == 5 and _greedy(logit_bias={0: -100.0}) == 1


def test_rows_without_adjustments_are_untouched_and_logprobs_are_the_models():
    params = [SamplingParams(temperature=0, logprobs=0), SamplingParams(temperature=0, logprobs=0,
                                                                        logit_bias={5: 100.0})]
    logits = LOGITS.repeat(2, 1)
    tokens, infos = Sampler()(logits, params, [4, 4], [(PROMPT, OUTPUT)] * 2)
    assert tokens == [0, 5]
    raw = LOGITS[0].log_softmax(-1)
    assert infos[1]["token_logprob"] == pytest.approx(float(raw[5]))  # before the bias, as vLLM reports them
    assert adjust_logits(logits, [SamplingParams()] * 2, [(PROMPT, OUTPUT)] * 2) is logits


def test_random_rows_sample_from_the_adjusted_distribution():
    params = SamplingParams(temperature=1.0, seed=3, logit_bias={0: -100.0, 1: -100.0})
    draws = {Sampler()(LOGITS, [params], [i], [(PROMPT, OUTPUT)])[0][0] for i in range(200)}
    assert draws and not draws & {0, 1}


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("presence_penalty", float("nan")), ("frequency_penalty", -2.01),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", float("inf")),
    ("logit_bias", {1: 101.0}), ("logit_bias", {-1: 1.0}), ("logit_bias", {"1": 1.0}), ("logit_bias", [1]),
])
def test_bad_values_are_refused_naming_the_field(field, value):
    with pytest.raises(SamplingError, match=f"^{field}:"):
        SamplingParams(**{field: value})


# ---- through the engine ------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return tiny_llm(tmp_path_factory.mktemp("tiny"))


def _gen(llm, **kw) -> list[int]:
    return llm.generate([[5, 9, 14, 3]], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, **kw))[0].token_ids


def test_through_the_engine_penalties_change_the_greedy_output_as_specified(llm):
    plain = _gen(llm)
    assert len(set(plain)) < len(plain)  # the tiny random model repeats itself greedily
    # its logits are all within a few units: a penalty of 2 per occurrence takes a seen token off the top
    for kw in (dict(presence_penalty=2.0), dict(frequency_penalty=2.0)):
        out = _gen(llm, **kw)
        assert len(set(out)) == len(out), kw
    # repetition_penalty also counts the prompt: the first token is no prompt token when its logit was positive
    assert _gen(llm, repetition_penalty=1.0) == plain
    assert _gen(llm, repetition_penalty=1.3) != plain
    assert llm.core.is_idle()


def test_through_the_engine_logit_bias_forces_and_bans(llm):
    assert set(_gen(llm, logit_bias={7: 100.0})) == {7}
    plain = _gen(llm)
    banned = _gen(llm, logit_bias={plain[0]: -100.0})
    assert plain[0] not in banned
    assert llm.core.is_idle()


def test_a_resumed_request_scores_its_tokens_so_far_as_if_it_had_made_them(llm):
    """What a migration does (cluster.ray_backend resumes with the output the client has): the penalty state
    is rebuilt from prompt + output, so the continuation equals the uninterrupted run's."""
    from engine.sequence import Sequence

    params = dict(max_tokens=24, temperature=0, ignore_eos=True, presence_penalty=0.7, frequency_penalty=0.4,
                  repetition_penalty=1.3, logit_bias={7: 1.5})
    whole = _gen(llm, **{k: v for k, v in params.items() if k not in ("max_tokens", "temperature", "ignore_eos")})
    assert whole != _gen(llm)  # the penalties matter here
    seq = Sequence("resumed", [5, 9, 14, 3], SamplingParams(**params), output_token_ids=list(whole[:10]))
    llm.core.add(seq)
    while not seq.is_finished:
        llm.core.step()
    assert seq.output_token_ids == whole
    assert llm.core.is_idle()
