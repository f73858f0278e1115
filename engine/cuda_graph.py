"""CUDA graphs for decode steps.

A decode step of a small model on a GPU is a few hundred short kernels, so
launching them costs more than running them. `DecodeGraphs` captures the
model's forward pass for a batch of decode tokens once per shape and replays
it: the inputs are copied into static buffers, the graph runs, and the hidden
states of the real rows are returned.

Shapes are bucketed so that a handful of graphs serve every step: the batch
is padded up to the next bucket of `BATCH_BUCKETS`, and the block-table width
to the next power of two (attention reads, and masks, that many blocks).
Padded rows write their key and value into a sink block that lies past the
pool's blocks (the KV cache is allocated with one extra block), so they never
touch a block of a real sequence; their outputs are dropped. Graphs are
captured lazily, on the first step of each shape, into one shared memory pool.

Only decode-only batches without a per-layer hook take this path; prefill
chunks and mixed batches run eagerly.
"""
from __future__ import annotations

import torch

from engine.attention import BatchMetadata

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def batch_bucket(n: int) -> int | None:
    """The smallest bucket that holds `n` rows, or None past the largest."""
    for b in BATCH_BUCKETS:
        if n <= b:
            return b
    return None


def width_bucket(n: int, max_width: int) -> int:
    """The block-table width a graph is captured for: `n` rounded up to a power of two, at most `max_width`."""
    w = 1
    while w < n:
        w *= 2
    return min(w, max_width)


class _Graph:
    """One captured forward pass and its static inputs and output."""

    def __init__(self, model, kv_caches, batch: int, width: int, block_size: int, sink: int, pool):
        dev = model.device
        self.ids = torch.zeros(batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(batch, dtype=torch.long, device=dev)
        self.slot_blocks = torch.full((batch,), sink, dtype=torch.long, device=dev)
        self.slot_offsets = torch.zeros(batch, dtype=torch.long, device=dev)
        self.tables = torch.full((batch, width), sink, dtype=torch.long, device=dev)
        self.lens = torch.ones(batch, dtype=torch.long, device=dev)
        self.keys = torch.arange(width * block_size, device=dev)
        self.mask = torch.ones(batch, 1, 1, width * block_size, dtype=torch.bool, device=dev)
        self.meta = BatchMetadata(self.slot_blocks, self.slot_offsets, num_decode=batch,
                                  decode_block_tables=self.tables, decode_context_lens=self.lens,
                                  decode_mask=self.mask)
        self.sink = sink
        run = lambda: model.forward(self.ids, self.positions, self.meta, kv_caches)  # noqa: E731
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm up (allocator, kernel selection) off the capture
            run()
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = run()

    def replay(self, ids, positions, meta: BatchMetadata) -> torch.Tensor:
        n = ids.shape[0]
        w = meta.decode_block_tables.shape[1]
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        self.slot_blocks[:n].copy_(meta.slot_blocks)
        self.slot_blocks[n:].fill_(self.sink)
        self.slot_offsets[:n].copy_(meta.slot_offsets)
        self.tables.fill_(self.sink)
        self.tables[:n, :w].copy_(meta.decode_block_tables)
        self.lens[:n].copy_(meta.decode_context_lens, non_blocking=True)
        self.lens[n:].fill_(1)
        torch.lt(self.keys, self.lens[:, None], out=self.mask.view(self.mask.shape[0], -1))
        self.graph.replay()
        return self.out[:n]


class DecodeGraphs:
    """Captured decode steps for one model and KV cache (CUDA only)."""

    def __init__(self, model, kv_caches: list[torch.Tensor], block_size: int, max_model_len: int,
                 max_num_seqs: int, sink_block: int):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_width = -(-max_model_len // block_size)
        self.max_batch = batch_bucket(min(max_num_seqs, BATCH_BUCKETS[-1])) or BATCH_BUCKETS[-1]
        self.sink = sink_block
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], _Graph] = {}

    def runs(self, num_tokens: int, meta: BatchMetadata) -> bool:
        """Whether this batch can replay a graph: decode tokens only, within the largest bucket."""
        return not meta.prefills and meta.num_decode == num_tokens and 0 < num_tokens <= self.max_batch

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: BatchMetadata) -> torch.Tensor:
        key = (batch_bucket(input_ids.shape[0]),
               width_bucket(meta.decode_block_tables.shape[1], self.max_width))
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = _Graph(self.model, self.kv_caches, key[0], key[1], self.block_size,
                                          self.sink, self.pool)
        return g.replay(input_ids, positions, meta)
