"""The batched sampler: logit_bias and penalties (`engine.penalties`),
greedy, temperature, top-k/top-p/min-p, logprobs.

A seeded request's random stream is a function of (seed, position): the
draw for output token i comes from a generator seeded by ``(seed, i)``, not
from how many draws some replica made before. So a request gives the same
tokens whatever shares its batch, after a preemption, and when its first
token is sampled on a prefill replica and the rest on a decode replica.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.penalties import adjust_logits
from engine.sampling import SamplingParams, stream_seed  # noqa: F401  (stream_seed: its home was here)

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


def _draw(probs: torch.Tensor, g: torch.Generator) -> int:
    """One token drawn from probs [V] by inverting its cumulative sum at a uniform draw: one random
    number a row. (An exponential race, argmax(p / E) with E ~ Exp(1) per entry, which
    torch.multinomial also runs, takes a log per vocabulary entry: 1.2 ms a row of the default
    model's 49k on a Zen 3 core, where this takes 0.08 ms, and was 9% of a served replica's time;
    BENCHMARKS.md "On the Zen 3, 2026-12-07 evening: one draw a row, and 6 x 16 AVX2 tiles".)
    An entry of probability 0 is never drawn: the cumulative sum does not pass u there."""
    cdf = probs.cumsum(-1)
    total = cdf[-1]
    i = int(torch.searchsorted(cdf, torch.rand(1, generator=g) * total, right=True))
    if i == cdf.numel():  # u rounded up to the total: the last entry of probability above 0
        i = int(torch.searchsorted(cdf, total.reshape(1)))
    return i


class Sampler:
    """Samples one token per row. Greedy rows are an argmax; seeded random
    rows draw from a generator seeded by (seed, position), the others from
    the sampler's own."""

    def __init__(self, seed: int = 0, device: str | torch.device = "cpu"):
        # random draws happen on the CPU (per-request generators live there),
        # so a seed gives the same tokens on any device
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,  # [N, V] float32
        params: list[SamplingParams],
        positions: list[int],  # each row's output position (tokens the request has produced so far)
        histories: list[tuple[Sequence[int], Sequence[int]]] | None = None,  # each row's (prompt, output) ids
        eos_ids: list[frozenset[int]] | None = None,  # each row's EOS tokens (min_tokens masks them)
    ) -> tuple[list[int], list[dict | None]]:
        """Logprobs are those of the model's logits, before bias, penalties and temperature."""
        want_logprobs = any(p.logprobs is not None for p in params)
        if want_logprobs or not all(p.is_greedy and not p.adjusts_logits for p in params):
            logits = logits.cpu()
        logprobs_all = logits.log_softmax(-1) if want_logprobs else None
        if any(p.adjusts_logits for p in params):
            if histories is None:
                raise ValueError("histories: needed for rows with penalties or logit_bias")
            logits = adjust_logits(logits, params, histories, eos_ids)
        tokens = logits.argmax(dim=-1).tolist()  # greedy for every row; random rows overwrite
        for i, p in enumerate(params):
            if p.is_greedy:
                continue
            row = _filter(logits[i] / p.temperature, p.top_k, p.top_p, p.min_p)
            probs = row.softmax(-1)
            g = self.generator
            if p.seed is not None:
                g = torch.Generator()
                g.manual_seed(stream_seed(p.seed, positions[i]))
            tokens[i] = _draw(probs, g)
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
