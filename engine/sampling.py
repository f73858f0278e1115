"""Sampling parameters, validated. Plain Python (the sampler is `engine.sampler`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import math
from numbers import Real

from engine.guided import GuidedSpec

# Temperatures below this sample as greedy: dividing logits by a smaller one
# overflows float32 (inf - inf = nan in the softmax), and the distribution is
# an argmax to float precision long before that.
GREEDY_TEMPERATURE = 1e-5


_MASK64 = (1 << 64) - 1


def stream_seed(seed: int, position: int) -> int:
    """The generator seed for the draw at output position ``position`` of a
    request seeded with ``seed`` (splitmix64 of the pair, so nearby seeds and
    positions give unrelated streams). Plain integers, so the frontends derive
    per-choice seeds with it too (`cluster.openai_protocol.choice_seed`)."""
    z = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded with ``seed`` and n > 1
    (choice 0 keeps the seed, so it is what n=1 gives): with `stream_seed`, a
    draw is a function of (seed, choice index, position)."""
    return seed if index == 0 else stream_seed(seed ^ 0x5EEDC401CE, index)


MAX_CHOICES = 16  # n
MAX_LOGPROBS = 20  # top alternatives a token's logprobs may list (logprobs, prompt_logprobs)


def bad_words_token_ids(encode, words) -> list[list[int]]:
    """vLLM's bad_words as token sequences: each word as it is and after a space (a word mid-sentence is
    usually its own token with the space in it), each distinct sequence once. ``encode``: text -> token
    ids, without special tokens. The words are checked already (`SamplingParams.validate`, and the
    frontends' cluster.serving.encode_bad_words)."""
    out: list[list[int]] = []
    for word in words:
        for text in (word.strip(), " " + word.strip()):
            ids = list(encode(text))
            if ids and ids not in out:
                out.append(ids)
    return out


class SamplingError(ValueError):
    """An invalid sampling parameter; the message names the field."""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (anything below GREEDY_TEMPERATURE) means greedy
    top_k: int = -1  # -1: disabled (0, as OpenAI clients send it, is read as -1)
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token
    # the prompt's logprobs: each prompt token's after the first (nothing precedes it), with this many top
    # alternatives (vLLM's prompt_logprobs; OpenAI's echo with logprobs). The prompt is computed whole:
    # no prefix-cache hit skips positions whose logits they need
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # vLLM's: no EOS or stop token can be sampled, and no stop string ends the output, before this many tokens
    min_tokens: int = 0
    include_stop_str_in_output: bool = False  # vLLM's: the stop string that ended the output is kept in its text
    allowed_token_ids: list[int] | None = None  # vLLM's: only these tokens can be sampled (None: any)
    # vLLM's bad_words: engine.LLM turns them into token sequences (`bad_words_token_ids`), and a sequence's
    # last token cannot be sampled where the output so far ends with the rest of it (one token: never)
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    guided: GuidedSpec | None = None  # the output must match this (engine.guided)
    # OpenAI's penalties, in [-2, 2], on the output so far: each logit minus
    # presence_penalty if the token occurs in it, minus frequency_penalty times its count
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's, > 0, on the prompt and the output so far: a positive logit divided by it, a negative one multiplied
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, in [-100, 100]
    # choices: the prompt is computed once and its full blocks shared by the n sequences (`Sequence.fork_of`)
    n: int = 1

    def __post_init__(self):
        if self.top_k == 0 and not isinstance(self.top_k, bool):
            self.top_k = -1
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [] if self.stop is None else list(self.stop) if isinstance(self.stop, tuple) else self.stop
        self.stop_token_ids = ([] if self.stop_token_ids is None else list(self.stop_token_ids)
                               if isinstance(self.stop_token_ids, tuple) else self.stop_token_ids)
        if isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words_token_ids, (tuple, list)):
            self.bad_words_token_ids = [list(w) if isinstance(w, tuple) else w for w in self.bad_words_token_ids]
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def for_choice(self, index: int) -> "SamplingParams":
        """The parameters of one of the n choices: n=1, and its own seed (`choice_seed`). The prompt's logprobs
        are computed by choice 0 alone (the others fork its prompt's blocks instead of computing them)."""
        return dataclasses.replace(self, n=1, seed=None if self.seed is None else choice_seed(self.seed, index),
                                   prompt_logprobs=self.prompt_logprobs if index == 0 else None,
                                   stop=list(self.stop), stop_token_ids=list(self.stop_token_ids),
                                   allowed_token_ids=None if self.allowed_token_ids is None
                                   else list(self.allowed_token_ids),
                                   bad_words=list(self.bad_words),
                                   bad_words_token_ids=[list(w) for w in self.bad_words_token_ids],
                                   logit_bias=dict(self.logit_bias))

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler changes this request's logits before sampling (penalties, logit_bias,
        allowed_token_ids, bad words, and min_tokens' mask of the stop tokens)."""
        return (self.has_penalties or bool(self.logit_bias) or self.allowed_token_ids is not None
                or self.min_tokens > 0 or bool(self.bad_words_token_ids))

    def validate(self) -> None:
        def bad(name: str, msg: str):
            raise SamplingError(f"{name}: {msg}, got {getattr(self, name)!r}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_real(v) -> bool:
            return isinstance(v, Real) and not isinstance(v, bool) and math.isfinite(v)

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if not is_real(self.temperature) or self.temperature < 0.0:
            bad("temperature", "must be a finite number >= 0")
        if not is_int(self.top_k) or self.top_k < -1:
            bad("top_k", "must be -1 (disabled) or a positive integer")
        if not is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                bad(name, f"must be an integer between 0 and {MAX_LOGPROBS}")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative integers")
        if self.seed is not None and not is_int(self.seed):
            bad("seed", "must be an integer")
        if self.guided is not None and not isinstance(self.guided, GuidedSpec):
            bad("guided", "must be an engine.guided.GuidedSpec")
        if not is_int(self.n) or not 1 <= self.n <= MAX_CHOICES:
            bad("n", f"must be an integer in [1, {MAX_CHOICES}]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not is_real(getattr(self, name)) or not -2.0 <= getattr(self, name) <= 2.0:
                bad(name, "must be in [-2, 2]")
        if not is_real(self.repetition_penalty) or self.repetition_penalty <= 0.0:
            bad("repetition_penalty", "must be a finite number > 0")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}]")
        if not isinstance(self.include_stop_str_in_output, bool):
            bad("include_stop_str_in_output", "must be true or false")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
                or any(not is_int(t) or t < 0 for t in self.allowed_token_ids)):
            bad("allowed_token_ids", "must be a non-empty list of non-negative token ids")
        if not isinstance(self.bad_words, list) or any(not isinstance(w, str) or not w.strip()
                                                      for w in self.bad_words):
            bad("bad_words", "must be a list of non-empty strings")
        if not isinstance(self.bad_words_token_ids, list) or any(
                not isinstance(w, list) or not w or any(not is_int(t) or t < 0 for t in w)
                for w in self.bad_words_token_ids):
            bad("bad_words_token_ids", "must be a list of non-empty lists of non-negative token ids")
        if self.guided is not None:  # the grammar decides which tokens may come and where the output ends
            for name in ("min_tokens", "allowed_token_ids"):
                if getattr(self, name):
                    bad(name, "cannot be combined with guided decoding (structured output)")
        if not isinstance(self.logit_bias, dict) or any(
                not is_int(t) or t < 0 or not is_real(b) or not -100.0 <= b <= 100.0
                for t, b in self.logit_bias.items()):
            bad("logit_bias", "must map non-negative token ids to numbers in [-100, 100]")
