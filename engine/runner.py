"""Turns a scheduled batch into tensors, runs the model, and samples."""
from __future__ import annotations

import torch

from engine.attention import BatchMetadata, PrefillChunk
from engine.guided import apply_masks
from engine.model import LayerHook, LlamaModel
from engine.profiling import FORWARD, SAMPLE, phase
from engine.sampler import Sampler
from engine.scheduler import ScheduledSeq

PROMPT_LOGPROB_ROWS = 256  # prompt positions scored per LM-head call (ModelRunner.prompt_logprobs)


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

    @torch.no_grad()
    def execute(self, batch: list[ScheduledSeq], layer_hook: LayerHook | None = None) -> dict[str, tuple[int, dict | None]]:
        """Run one forward pass; returns {request_id: (token, logprobs)} for sampling sequences."""
        with phase(FORWARD):
            input_ids, positions, meta, sample_rows = self.prepare(batch)
            if self.graphs is not None and layer_hook is None and self.graphs.runs(len(input_ids), meta):
                hidden = self.graphs.forward(input_ids, positions, meta)
            else:
                hidden = self.model.forward(input_ids, positions, meta, self.kv_caches, layer_hook)
        samplers = [s for s in batch if s.samples]
        with phase(SAMPLE):
            if any(s.seq.prompt_logprobs_pending for s in batch):
                self.prompt_logprobs(batch, hidden)
            if not samplers:
                return {}
            return self.sample(samplers, self.model.compute_logits(hidden[sample_rows]))

    def prompt_logprobs(self, batch: list[ScheduledSeq], hidden: torch.Tensor) -> None:
        """Append to each sequence that asked for its prompt's logprobs those this step's positions give:
        position p's logits score prompt token p + 1 (its logprob, its rank, the top alternatives), up to the
        prompt's last token. The LM head runs on those rows a slice at a time, so a long chunk's logits
        ([rows, vocab] float32) never exist at once."""
        rows: list[int] = []
        owners: list[tuple[ScheduledSeq, int]] = []  # (scheduled sequence, position) of each row
        for s, row0 in _row_starts(batch):
            seq = s.seq
            first = len(seq.prompt_logprobs)  # the positions before it were scored already
            if not seq.prompt_logprobs_pending or s.start > first:
                continue
            for p in range(first, min(s.start + s.num_new_tokens, seq.num_prompt_tokens - 1)):
                rows.append(row0 + p - s.start)
                owners.append((s, p))
        for i in range(0, len(rows), PROMPT_LOGPROB_ROWS):
            part = owners[i:i + PROMPT_LOGPROB_ROWS]
            lp = self.model.compute_logits(hidden[rows[i:i + PROMPT_LOGPROB_ROWS]]).float().log_softmax(-1).cpu()
            targets = torch.tensor([s.seq.prompt_token_ids[p + 1] for s, p in part])
            chosen = lp.gather(1, targets[:, None])
            ranks = (lp > chosen).sum(1).add_(1).tolist()
            k = max(s.seq.params.prompt_logprobs for s, _ in part)
            top_v, top_i = lp.topk(k, dim=1) if k else (None, None)
            for j, ((s, _), value, rank) in enumerate(zip(part, chosen[:, 0].tolist(), ranks)):
                n = s.seq.params.prompt_logprobs
                top = list(zip(top_i[j, :n].tolist(), top_v[j, :n].tolist())) if n else []
                s.seq.prompt_logprobs.append({"token_logprob": value, "top": top, "rank": rank})

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
