import math

import pytest
from hypothesis import given, strategies as st

from cluster.types import InvalidRequestError
from cluster.validation import check_model, check_request_id, validate_request

CTX, VOCAB = 100, 50


def check(prompt=(1, 2, 3), **kw):
    return validate_request(list(prompt), max_model_len=CTX, vocab_size=VOCAB, **kw)


def test_defaults():
    p = check()
    assert p.max_tokens == CTX - 3 and p.temperature == 1.0 and p.top_k == -1 and p.logprobs is None


@pytest.mark.parametrize("kw, field", [
    (dict(temperature=math.nan), "temperature"), (dict(temperature=math.inf), "temperature"),
    (dict(top_p=math.nan), "top_p"), (dict(min_p=-0.1), "min_p"), (dict(logprobs=-1), "logprobs"),
    (dict(stop=["x"] * 17), "stop"), (dict(prompt=[-1]), "prompt"),
])
def test_bad_values_name_the_field(kw, field):
    with pytest.raises(InvalidRequestError) as info:
        check(**kw)
    assert info.value.field == field and str(info.value).startswith(f"{field}: ")


def test_model_and_request_id():
    check_model("", "m")
    check_model("m", "m")
    with pytest.raises(InvalidRequestError, match="^model: "):
        check_model("other", "m")
    with pytest.raises(InvalidRequestError, match="^request_id: "):
        check_request_id("x" * 129)


@given(n=st.integers(1, CTX + 5), max_tokens=st.one_of(st.none(), st.integers(-5, CTX + 5)))
def test_prompt_plus_output_always_fits_the_context(n, max_tokens):
    try:
        p = check([1] * n, max_tokens=max_tokens)
    except InvalidRequestError as e:
        assert e.field in ("prompt", "max_tokens")
        return
    assert 1 <= p.max_tokens and n + p.max_tokens <= CTX
