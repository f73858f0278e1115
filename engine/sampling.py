"""Sampling parameters, validated. Plain Python (the sampler is `engine.sampler`)."""
from __future__ import annotations

from dataclasses import dataclass, field

import math
from numbers import Real

from engine.guided import GuidedSpec

# Temperatures below this sample as greedy: dividing logits by a smaller one
# overflows float32 (inf - inf = nan in the softmax), and the distribution is
# an argmax to float precision long before that.
GREEDY_TEMPERATURE = 1e-5


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
    skip_special_tokens: bool = True
    guided: GuidedSpec | None = None  # the output must match this (engine.guided)

    def __post_init__(self):
        if self.top_k == 0 and not isinstance(self.top_k, bool):
            self.top_k = -1
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [] if self.stop is None else list(self.stop) if isinstance(self.stop, tuple) else self.stop
        self.stop_token_ids = ([] if self.stop_token_ids is None else list(self.stop_token_ids)
                               if isinstance(self.stop_token_ids, tuple) else self.stop_token_ids)
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

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
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            bad("logprobs", "must be an integer between 0 and 20")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative integers")
        if self.seed is not None and not is_int(self.seed):
            bad("seed", "must be an integer")
        if self.guided is not None and not isinstance(self.guided, GuidedSpec):
            bad("guided", "must be an engine.guided.GuidedSpec")
