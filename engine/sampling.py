"""Sampling parameters (validated) and the batched sampler."""
from __future__ import annotations

from dataclasses import dataclass, field

import math
from numbers import Real

import torch

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
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token
    skip_special_tokens: bool = True

    def __post_init__(self):
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
            bad("top_k", "must be -1, 0 (disabled) or a positive integer")
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


def _filter(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    # logits: [V] float32 (already temperature-scaled); excluded entries set to -inf
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = logits.sort(descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p (always keeps the top token)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class Sampler:
    """Samples one token per row. Greedy rows are an argmax; random rows use
    their own generator when seeded, so a seeded request draws the same
    tokens whatever else shares its batch."""

    def __init__(self, seed: int = 0, device: str | torch.device = "cpu"):
        # random draws happen on the CPU (per-request generators live there),
        # so a seed gives the same tokens on any device
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,  # [N, V] float32
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> tuple[list[int], list[dict | None]]:
        tokens = logits.argmax(dim=-1).tolist()  # greedy for every row; random rows overwrite
        want_logprobs = any(p.logprobs is not None for p in params)
        if want_logprobs or not all(p.is_greedy for p in params):
            logits = logits.cpu()
        logprobs_all = logits.log_softmax(-1) if want_logprobs else None
        for i, p in enumerate(params):
            if p.is_greedy:
                continue
            row = _filter(logits[i] / p.temperature, p.top_k, p.top_p, p.min_p)
            probs = row.softmax(-1)
            g = generators[i] or self.generator
            # exponential race: argmax(p / E) with E ~ Exp(1) draws from p
            e = torch.empty_like(probs).exponential_(generator=g)
            tokens[i] = int((probs / e).argmax())
        infos: list[dict | None] = []
        for i, p in enumerate(params):
            if p.logprobs is None:
                infos.append(None)
                continue
            lp = logprobs_all[i]
            info = {"token_logprob": float(lp[tokens[i]]), "top": []}
            if p.logprobs:
                vals, idx = lp.topk(p.logprobs)
                info["top"] = list(zip(idx.tolist(), vals.tolist()))
            infos.append(info)
        return tokens, infos
