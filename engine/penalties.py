"""Logit adjustments before sampling: logit_bias and the three penalties.

The state a penalty needs is the request's tokens so far, so it is rebuilt
from them at every step (prompt + output, as the sequence holds them): a
request scores the same whether its first token was sampled on a prefill
replica and the rest on a decode replica, after a preemption, or after it
migrated with the tokens its client already had. In order, per row:

    allowed_token_ids   logit[t] = -inf for every t not in it
    bad_words           logit[w[-1]] = -inf for each word's tokens w whose w[:-1] ends the output
    min_tokens          logit[t] = -inf for EOS (unless ignore_eos) and stop_token_ids while the output is shorter
    logit_bias          logit[t] += bias[t]
    repetition_penalty  for t in prompt + output: logit[t] / r if logit[t] > 0 else logit[t] * r
    frequency_penalty   logit[t] -= f * count of t in the output
    presence_penalty    logit[t] -= p * (t occurs in the output)
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampling import SamplingParams


def adjust_logits(
    logits: torch.Tensor,  # [N, V] float32
    params: list[SamplingParams],
    histories: list[tuple[Sequence[int], Sequence[int]]],  # each row's (prompt ids, output ids so far)
    eos_ids: list[frozenset[int]] | None = None,  # each row's EOS tokens, for min_tokens (None: none)
) -> torch.Tensor:
    """``logits`` with each row's adjustments applied (a new tensor when any row has one; else ``logits``)."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    out = logits.clone()
    vocab = logits.shape[-1]
    dev = logits.device
    for i in rows:
        p, (prompt, output) = params[i], histories[i]
        row = out[i]  # [V], a view
        if p.allowed_token_ids is not None:
            keep = torch.full_like(row, float("-inf"))
            ids = torch.tensor([t for t in p.allowed_token_ids if t < vocab], dtype=torch.long, device=dev)
            keep[ids] = row[ids]
            row.copy_(keep)
        if p.bad_words_token_ids:
            banned = sorted({w[-1] for w in p.bad_words_token_ids
                             if w[-1] < vocab and (len(w) == 1 or _ends_with(output, w[:-1]))})
            if banned:
                row[torch.tensor(banned, dtype=torch.long, device=dev)] = float("-inf")
        if p.min_tokens > len(output):  # what would end the output (EOS does not under ignore_eos)
            ends = set(p.stop_token_ids) | (set() if p.ignore_eos or not eos_ids else set(eos_ids[i]))
            banned = sorted(t for t in ends if t < vocab)
            if banned:
                row[torch.tensor(banned, dtype=torch.long, device=dev)] = float("-inf")
        if p.logit_bias:
            ids = [t for t in p.logit_bias if t < vocab]
            row[torch.tensor(ids, dtype=torch.long, device=dev)] += torch.tensor(
                [float(p.logit_bias[t]) for t in ids], dtype=row.dtype, device=dev)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(list(prompt) + list(output), dtype=torch.long, device=dev).unique()
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and len(output):
            counts = torch.bincount(torch.tensor(list(output), dtype=torch.long, device=dev), minlength=vocab)
            counts = counts[:vocab].to(row.dtype)  # [V]
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return out


def _ends_with(output: Sequence[int], prefix: list[int]) -> bool:
    n = len(prefix)
    return len(output) >= n and list(output[len(output) - n:]) == prefix
