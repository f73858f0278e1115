"""Turns a scheduled batch into tensors, runs the model, and samples."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention import BatchMetadata, PrefillChunk
from engine.guided import apply_masks
from engine.model import LayerHook, LlamaModel
from engine.profiling import FORWARD, SAMPLE, phase
from engine.sampler import Sampler
from engine.sampling import MAX_LOGPROBS
from engine.scheduler import ScheduledSeq

PROMPT_LOGPROB_ROWS = 256  # prompt positions scored per LM-head call (score_rows)
SCORE_WIDTH = 2 + 2 * MAX_LOGPROBS  # the most numbers a scored position comes back as (PromptScores.width)


def _split(batch: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], list[ScheduledSeq]]:
    """(decode rows, prefill chunks), in batch order each: a step's rows hold the decodes first."""
    decodes = [s for s in batch if s.num_new_tokens == 1 and s.start > 0]
    return decodes, [s for s in batch if not (s.num_new_tokens == 1 and s.start > 0)]


def _row_starts(batch: list[ScheduledSeq]):
    """(scheduled sequence, its first row in the step's hidden states), in `ModelRunner.prepare`'s order."""
    decodes, prefills = _split(batch)
    row = 0
    for s in decodes + prefills:
        yield s, row
        row += s.num_new_tokens


@dataclass
class PromptScores:
    """The prompt positions a step scores (`SamplingParams.prompt_logprobs`): position p's logits
    score prompt token p + 1. Rank 0 plans them (`plan_scores`); the other ranks of a tensor- or
    pipeline-parallel replica get ``rows``, ``targets`` and ``top`` in the step message
    (engine.parallel.step) and join the LM head's calls on those rows, in the same slices, and the
    rank that holds the full logits (rank 0; with pipeline parallelism the last stage's leader)
    reduces each row to `width` numbers (`score_rows`), which rank 0 hands to the sequences (`apply`)."""

    rows: list[int]  # each scored position's row in the step's hidden states
    targets: list[int]  # the prompt token it scores
    top: int  # alternatives each row carries: the step's largest prompt_logprobs
    owners: list[tuple[object, int]] = field(default_factory=list)  # rank 0: (sequence, position) of each row

    @property
    def width(self) -> int:
        """Numbers per scored row: the target's logprob, its rank, `top` ids, `top` logprobs."""
        return 2 + 2 * self.top

    def apply(self, packed: torch.Tensor) -> None:
        """Rank 0: append each row's result ([len(rows), width], `score_rows`) to its sequence. Only
        the next position a sequence lacks is taken: one computed again (after a preemption, or
        one the pipeline returns late) adds nothing."""
        packed = packed.view(len(self.rows), self.width).cpu()
        values, ranks = packed[:, 0].tolist(), packed[:, 1].to(torch.int64).tolist()
        ids = packed[:, 2:2 + self.top].to(torch.int64).tolist()
        tops = packed[:, 2 + self.top:].tolist()
        for (seq, p), value, rank, i, v in zip(self.owners, values, ranks, ids, tops):
            if p != len(seq.prompt_logprobs):
                continue
            n = seq.params.prompt_logprobs
            seq.prompt_logprobs.append({"token_logprob": value, "top": list(zip(i[:n], v[:n])), "rank": rank})


def plan_scores(batch: list[ScheduledSeq]) -> PromptScores | None:
    """The prompt positions `batch` scores: of each sequence that asked for its prompt's logprobs,
    those of its rows up to the prompt's second-to-last token, less those it has (a preempted
    sequence computing its prompt again). None: nothing to score."""
    if not any(s.seq.prompt_logprobs_pending for s in batch):  # (every step asks: the common answer first)
        return None
    plan = PromptScores([], [], 0)
    for s, row0 in _row_starts(batch):
        seq = s.seq
        if not seq.prompt_logprobs_pending:
            continue
        plan.top = max(plan.top, seq.params.prompt_logprobs)
        end = min(s.start + s.num_new_tokens, seq.num_prompt_tokens - 1)
        for p in range(max(s.start, len(seq.prompt_logprobs)), end):
            plan.rows.append(row0 + p - s.start)
            plan.targets.append(seq.prompt_token_ids[p + 1])
            plan.owners.append((seq, p))
    return plan if plan.rows else None


def score_rows(model: LlamaModel, hidden: torch.Tensor, scores: PromptScores) -> torch.Tensor | None:
    """Each scored row's logprob of its target, the target's rank and the top alternatives
    ([len(rows), width] float32; ids are exact in float32 below 2^24), where this rank gets the full
    logits; None on the ranks that only contribute their vocabulary slice. The LM head runs on
    PROMPT_LOGPROB_ROWS rows at a time, so a long chunk's logits ([rows, vocab]) never exist at once."""
    out = []
    for i in range(0, len(scores.rows), PROMPT_LOGPROB_ROWS):
        logits = model.compute_logits(hidden[scores.rows[i:i + PROMPT_LOGPROB_ROWS]])
        if logits is None:
            continue
        lp = logits.float().log_softmax(-1)
        targets = torch.tensor(scores.targets[i:i + PROMPT_LOGPROB_ROWS], device=lp.device)
        chosen = lp.gather(1, targets[:, None])
        rank = (lp > chosen).sum(1, keepdim=True).add_(1).float()
        top_v, top_i = lp.topk(scores.top, dim=1)
        out.append(torch.cat([chosen, rank, top_i.float(), top_v], dim=1))
    return torch.cat(out) if out else None


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_caches: list[torch.Tensor], block_size: int, seed: int = 0):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = model.device
        self.sampler = Sampler(seed, self.device)
        self.graphs = None  # engine.cuda_graph.DecodeGraphs on CUDA unless enforce_eager

    def prepare(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, BatchMetadata, list[int]]:
        """Decode sequences first, then prefill chunks. Returns input ids,
        positions, attention metadata, and the batch index of each sampling
        position (in ``batch`` order)."""
        bs = self.block_size
        decodes, prefills = _split(batch)
        ids: list[int] = []
        pos: list[int] = []
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        sample_index: dict[int, int] = {}
        for s in decodes:
            sample_index[id(s)] = len(ids)
            ids.append(s.seq.token_at(s.start))
            pos.append(s.start)
            slot_blocks.append(s.seq.block_ids[s.start // bs])
            slot_offsets.append(s.start % bs)
        meta = BatchMetadata(slot_blocks=None, slot_offsets=None, num_decode=len(decodes))
        if decodes:
            ctx = [s.start + 1 for s in decodes]
            nb = [-(-c // bs) for c in ctx]
            max_nb = max(nb)
            # one tensor from padded lists: a decode step's preparation is on every token's path
            # (the padding mask, which only torch's attention needs, is made there: engine.attention)
            meta.decode_block_tables = torch.tensor(
                [s.seq.block_ids[:n] + [0] * (max_nb - n) for s, n in zip(decodes, nb)], dtype=torch.long,
                device=self.device)
            meta.decode_context_lens = torch.tensor(ctx)
        for s in prefills:
            n, start = s.num_new_tokens, s.start
            q0 = len(ids)
            ids.extend(s.seq.tokens_slice(start, start + n))
            pos.extend(range(start, start + n))
            blocks = s.seq.block_ids
            for p in range(start, start + n):
                slot_blocks.append(blocks[p // bs])
                slot_offsets.append(p % bs)
            ctx = start + n
            meta.prefills.append(PrefillChunk(
                query_start=q0, num_queries=n, context_len=ctx,
                block_table=torch.tensor(blocks[: -(-ctx // bs)], dtype=torch.long, device=self.device),
            ))
            if s.samples:
                sample_index[id(s)] = q0 + n - 1
        dev = self.device
        meta.slot_blocks = torch.tensor(slot_blocks, dtype=torch.long, device=dev)
        meta.slot_offsets = torch.tensor(slot_offsets, dtype=torch.long, device=dev)
        sample_rows = [sample_index[id(s)] for s in batch if s.samples]
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(pos, dtype=torch.long, device=dev),
                meta, sample_rows)

    def execute(self, batch: list[ScheduledSeq], layer_hook: LayerHook | None = None) -> dict[str, tuple[int, dict | None]]:
        """Run one forward pass; returns {request_id: (token, logprobs)} for sampling sequences."""
        return self.run(batch, plan_scores(batch), layer_hook)

    @torch.no_grad()
    def run(self, batch: list[ScheduledSeq], scores: PromptScores | None, layer_hook: LayerHook | None = None
            ) -> dict[str, tuple[int, dict | None]]:
        """`execute` with the step's prompt positions to score already planned (`plan_scores`)."""
        with phase(FORWARD):
            input_ids, positions, meta, sample_rows = self.prepare(batch)
            if self.graphs is not None and layer_hook is None and self.graphs.runs(len(input_ids), meta):
                hidden = self.graphs.forward(input_ids, positions, meta)
            else:
                hidden = self.model.forward(input_ids, positions, meta, self.kv_caches, layer_hook)
        samplers = [s for s in batch if s.samples]
        with phase(SAMPLE):
            if scores is not None:
                scores.apply(score_rows(self.model, hidden, scores))
            if not samplers:
                return {}
            return self.sample(samplers, self.model.compute_logits(hidden[sample_rows]))

    def sample(self, samplers: list[ScheduledSeq], logits: torch.Tensor) -> dict[str, tuple[int, dict | None]]:
        """The sampling sequences' next tokens from their logits rows ([len(samplers), V])."""
        guided = [i for i, s in enumerate(samplers) if s.seq.grammar is not None]
        if guided:
            apply_masks(logits, [samplers[i].seq.grammar for i in guided], guided)
        tokens, infos = self.sampler(
            logits, [s.seq.params for s in samplers], [s.seq.num_output_tokens for s in samplers],
            [(s.seq.prompt_token_ids, s.seq.output_token_ids) for s in samplers],
            [s.seq.eos_token_ids for s in samplers])
        return {s.seq.request_id: (t, info) for s, t, info in zip(samplers, tokens, infos)}
