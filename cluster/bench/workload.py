"""What the benchmark sends, and when: request specs and arrival times.

Everything here is driven by a seeded `random.Random`, so the same flags give
the same prompts and the same arrival schedule.

- Random prompts: lengths uniform in ``[len * (1 - r), len * (1 + r)]`` for
  ``--range-ratio r`` (at least 1). For gRPC a prompt is random token ids
  below the served vocabulary size, so its length is exact. For HTTP it is
  text of random words from `WORDS`; its token count depends on the server's
  tokenizer (about one token per word), so the records take the server's
  count from the stream's usage when it is reported.
- A dataset: JSON lines with ``prompt`` (text) and optional ``output_len``;
  requests are drawn from a seeded shuffle, repeated when the file is short.
- Arrivals: gaps drawn from a gamma distribution of shape ``burstiness`` and
  mean ``1 / rate`` (shape 1 is a Poisson process; below 1 is burstier);
  rate ``inf`` sends everything at once.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

# Common English words, each one token in most BPE vocabularies.
WORDS = tuple("""
the of and to in is was for on that with as by at from his her he she it they we you this be are were
have has had not but or an which one all their there been if more when will would who so no time year
people way day man thing woman life child world school state family student group country problem hand
part place case week company system program question work government number night point home water room
mother area money story fact month lot right study book eye job word business issue side kind head house
service friend father power hour game line end member law car city community name president team minute
idea kid body information back parent face others level office door health person art war history party
result change morning reason research girl guy moment air teacher force education good new first last
long great little own other old big high different small large next early young important few public
""".split())


class WorkloadError(ValueError):
    """A workload flag or dataset line is unusable; the message names it."""


@dataclass(frozen=True)
class RequestSpec:
    index: int
    prompt: str | list[int]  # text (HTTP, datasets) or token ids (gRPC random prompts)
    prompt_len: int  # tokens, or words for generated text
    output_len: int


def sample_lengths(rng: random.Random, mean: int, range_ratio: float, n: int) -> list[int]:
    if mean < 1:
        raise WorkloadError(f"lengths must be >= 1, got {mean}")
    if not 0 <= range_ratio < 1:
        raise WorkloadError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    lo, hi = max(1, math.floor(mean * (1 - range_ratio))), max(1, math.ceil(mean * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float, seed: int,
                    vocab_size: int | None = None, variant: int = 0) -> list[RequestSpec]:
    """Token-id prompts when ``vocab_size`` is given (gRPC), else word prompts (HTTP).

    The lengths depend on ``seed`` only; the prompts' content on ``seed`` and ``variant``.
    """
    rng = random.Random(seed)
    in_lens = sample_lengths(rng, input_len, range_ratio, num_prompts)
    out_lens = sample_lengths(rng, output_len, range_ratio, num_prompts)
    rng = random.Random(f"{seed}/{variant}")
    specs = []
    for i, (n_in, n_out) in enumerate(zip(in_lens, out_lens)):
        if vocab_size is not None:
            prompt: str | list[int] = [rng.randrange(vocab_size) for _ in range(n_in)]
        else:
            prompt = " ".join(rng.choice(WORDS) for _ in range(n_in))
        specs.append(RequestSpec(i, prompt, n_in, n_out))
    return specs


def dataset_requests(path: str | Path, num_prompts: int, default_output_len: int, seed: int) -> list[RequestSpec]:
    rows = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise WorkloadError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise WorkloadError(f"{where}: needs a non-empty string field 'prompt'")
        out = row.get("output_len", default_output_len)
        if not isinstance(out, int) or isinstance(out, bool) or out < 1:
            raise WorkloadError(f"{where}: output_len must be an integer >= 1, got {out!r}")
        rows.append((row["prompt"], out))
    if not rows:
        raise WorkloadError(f"{path}: no prompts")
    rng = random.Random(seed)
    order: list[int] = []
    while len(order) < num_prompts:
        order.extend(rng.sample(range(len(rows)), len(rows)))
    return [RequestSpec(i, rows[j][0], len(rows[j][0].split()), rows[j][1]) for i, j in enumerate(order[:num_prompts])]


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times in seconds from the run's start (the first request goes at 0)."""
    if not rate > 0:
        raise WorkloadError(f"request rates must be > 0 (or inf), got {rate}")
    if not burstiness > 0:
        raise WorkloadError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out
