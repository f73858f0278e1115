"""What rank 0 tells the other ranks once per step: ids and diffs, never objects.

Rank 0 owns the scheduler and the block pool. Each sequence it has shown the
other ranks gets a small integer slot; the other ranks mirror each slot's
block ids. A step message is one flat int64 array:

    [STEP, n_drop, n_set, n_rows, n_tokens,
     drop slots...,                      sequences gone (finished, aborted) or preempted
     (slot, keep, n_new, ids...)...,     block table diffs: keep the first `keep` ids, append the new ones
     (slot, start, n, samples)...,       the batch, in the scheduler's order; samples 0 (no), 1, or
                                         ARGMAX: a plain greedy row (no penalties, bias, logprobs or
                                         grammar), whose token is its logits' argmax wherever computed
     tokens...,                          each row's n tokens, concatenated
     n_scored, top,                      the prompt positions the step scores (engine.runner.PromptScores):
     rows..., targets...]                their rows in the step's hidden states, the tokens they score

A preempted sequence is dropped (its blocks were freed) and comes back as a new one.
`StepEncoder` (rank 0) builds messages; `StepDecoder` (the others) applies
them and returns rows that `engine.runner.ModelRunner.prepare` takes like
scheduled sequences, so every rank builds the same tensors.
"""
from __future__ import annotations

import numpy as np

from engine.runner import PromptScores
from engine.scheduler import ScheduledSeq

STEP, STOP = 1, 2
_HEADER = 5
ARGMAX = 2  # a row's `samples`: greedy with nothing to apply to its logits (the last pipeline stage may pick it)


def is_plain_greedy(seq) -> bool:
    """Whether `seq`'s next token is its logits' argmax and nothing else is needed from them
    (engine.sampler's greedy path, no logprobs, no guided-decoding mask)."""
    p = seq.params
    return p.is_greedy and not p.adjusts_logits and p.logprobs is None and seq.grammar is None


class StepEncoder:
    def __init__(self):
        self._slot_of: dict[str, int] = {}  # request id -> slot
        self._mirror: dict[int, tuple[object, list[int]]] = {}  # slot -> (sequence, block ids the ranks hold)
        self._free: list[int] = []

    def encode(self, batch: list[ScheduledSeq], scores: PromptScores | None = None) -> bytes:
        drops: list[int] = []
        for rid, slot in list(self._slot_of.items()):
            seq = self._mirror[slot][0]
            if seq.is_finished or not seq.block_ids:  # gone, or preempted (its blocks freed)
                drops.append(slot)
                del self._slot_of[rid], self._mirror[slot]
                self._free.append(slot)
        sets: list[int] = []
        rows: list[int] = []
        tokens: list[int] = []
        for s in batch:
            seq = s.seq
            slot = self._slot_of.get(seq.request_id)
            if slot is None:
                slot = self._free.pop() if self._free else len(self._mirror)
                self._slot_of[seq.request_id] = slot
                self._mirror[slot] = (seq, [])
            elif self._mirror[slot][0] is not seq:  # the same id again, a new sequence: its table from scratch
                self._mirror[slot] = (seq, [])
            # (a table that is not an extension of the mirrored one, e.g. blocks given back and
            # taken again within a step, is sent whole: keep 0)
            held = self._mirror[slot][1]
            blocks = seq.block_ids
            n = len(held)
            if blocks[:n] == held:
                if len(blocks) > n:
                    sets += (slot, n, len(blocks) - n, *blocks[n:])
                    held.extend(blocks[n:])
            else:
                sets += (slot, 0, len(blocks), *blocks)
                held[:] = blocks
            rows += (slot, s.start, s.num_new_tokens, (ARGMAX if is_plain_greedy(seq) else 1) if s.samples else 0)
            tokens += seq.tokens_slice(s.start, s.start + s.num_new_tokens)
        scored = [len(scores.rows), scores.top, *scores.rows, *scores.targets] if scores is not None else [0, 0]
        msg = [STEP, len(drops), len(sets), len(batch), len(tokens), *drops, *sets, *rows, *tokens, *scored]
        return np.asarray(msg, dtype=np.int64).tobytes()


def stop_message() -> bytes:
    return np.asarray([STOP, 0, 0, 0, 0], dtype=np.int64).tobytes()


class _MirrorSeq:
    """The part of a Sequence that ModelRunner.prepare reads, for one step."""

    __slots__ = ("block_ids", "start", "tokens")

    def __init__(self, block_ids: list[int], start: int, tokens: list[int]):
        self.block_ids, self.start, self.tokens = block_ids, start, tokens

    def token_at(self, i: int) -> int:
        return self.tokens[i - self.start]

    def tokens_slice(self, a: int, b: int) -> list[int]:
        return self.tokens[a - self.start:b - self.start]


class MirrorRow:
    """A scheduled sequence as ModelRunner.prepare sees it."""

    __slots__ = ("seq", "start", "num_new_tokens", "samples", "argmax")

    def __init__(self, seq: _MirrorSeq, start: int, n: int, samples: int):
        self.seq, self.start, self.num_new_tokens = seq, start, n
        self.samples, self.argmax = bool(samples), samples == ARGMAX


class StepDecoder:
    def __init__(self):
        self.blocks: dict[int, list[int]] = {}  # slot -> block ids

    def decode(self, payload) -> tuple[list[MirrorRow], PromptScores | None] | None:
        """The step's rows in batch order and the prompt positions it scores, or None for STOP."""
        m = np.frombuffer(payload, dtype=np.int64).tolist()
        kind, n_drop, n_set, n_rows, n_tokens = m[:_HEADER]
        if kind == STOP:
            return None
        i = _HEADER
        for slot in m[i:i + n_drop]:
            self.blocks.pop(slot, None)
        i += n_drop
        end = i + n_set
        while i < end:
            slot, keep, n = m[i:i + 3]
            held = self.blocks.setdefault(slot, [])
            del held[keep:]
            held.extend(m[i + 3:i + 3 + n])
            i += 3 + n
        tok = i + 4 * n_rows
        rows = []
        for r in range(n_rows):
            slot, start, n, samples = m[i + 4 * r:i + 4 * r + 4]
            rows.append(MirrorRow(_MirrorSeq(self.blocks[slot], start, m[tok:tok + n]), start, n, samples))
            tok += n
        n_scored, top = m[tok:tok + 2]
        scores = PromptScores(m[tok + 2:tok + 2 + n_scored], m[tok + 2 + n_scored:tok + 2 + 2 * n_scored], top)
        return rows, scores if n_scored else None
