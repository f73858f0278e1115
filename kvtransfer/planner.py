"""Transfer planning: which blocks of which layer go in which message. Plain Python.

A transfer moves, for every layer, the slabs ``kv[layer][src_block_ids[i]]``
into ``kv[layer][dst_block_ids[i]]``; between replicas of different
tensor-parallel layouts, a unit of the reshard plan (reshard.py) at a time:
a global KV-head range read from one prefill rank's cache. The planner cuts each layer into chunks
of at most ``max_chunk_bytes`` (a chunk names a range of *indices* into the
ticket's block list, never raw block ids: the receiver maps indices to its own
blocks), and finds runs of consecutive block ids so a mover copies runs rather
than single slabs.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ChunkPlan:
    """Slabs of layers ``[layer, layer + num_layers)`` x ticket blocks ``[first_block, +num_blocks)``; of them,
    global KV heads ``[head_start, +num_heads)``, read from prefill rank ``src_rank`` at its local head
    ``src_head``. num_heads 0: every head (a one-rank sender's whole slabs)."""

    layer: int
    first_block: int  # index into the ticket's block list
    num_blocks: int
    num_layers: int = 1
    head_start: int = 0
    num_heads: int = 0
    src_rank: int = 0
    src_head: int = 0

    @property
    def layers(self) -> range:
        return range(self.layer, self.layer + self.num_layers)

    @property
    def source(self) -> tuple[int, int, int, int, int, int]:
        """What a chunk shares with the chunks it may merge with (every field but the layers)."""
        return (self.first_block, self.num_blocks, self.head_start, self.num_heads, self.src_rank, self.src_head)


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    if num_tokens <= 0:
        raise ValueError(f"num_tokens must be > 0, got {num_tokens}")
    return -(-num_tokens // block_size)


def plan_layer(layer: int, num_blocks: int, bytes_per_block: int, max_chunk_bytes: int) -> list[ChunkPlan]:
    """The chunks of one layer, in block order, each at most max_chunk_bytes (at least one block)."""
    per_chunk = max(1, max_chunk_bytes // max(1, bytes_per_block))
    return [ChunkPlan(layer, start, min(per_chunk, num_blocks - start))
            for start in range(0, num_blocks, per_chunk)]


def coalesce_layers(chunks: list[ChunkPlan], bytes_per_block, max_chunk_bytes: int) -> list[ChunkPlan]:
    """Merge chunks of consecutive layers (same blocks, same heads from the same rank) up to max_chunk_bytes.

    bytes_per_block: an int, or a function of the chunk (a head range's share of a block).

    Used when the sender has fallen behind the per-layer hook: several small
    layers then travel as one message instead of one message each.
    """
    size = bytes_per_block if callable(bytes_per_block) else (lambda c: bytes_per_block)
    out: list[ChunkPlan] = []
    for c in chunks:
        prev = out[-1] if out else None
        if (prev is not None and prev.layer + prev.num_layers == c.layer and c.num_layers == 1
                and prev.source == c.source
                and (prev.num_layers + 1) * c.num_blocks * size(c) <= max_chunk_bytes):
            out[-1] = replace(prev, num_layers=prev.num_layers + 1)
        else:
            out.append(c)
    return out


def merge_heads(chunks: list[ChunkPlan], bytes_per_block, max_chunk_bytes: int) -> list[ChunkPlan]:
    """Merge chunks of the same layers and blocks, read from one source rank, whose KV-head ranges follow
    each other both in that rank and among the model's heads, up to max_chunk_bytes.

    bytes_per_block: a function of the chunk (a head range's share of a block).

    A one-rank prefill sending to a TP=2 decode has a unit per decode rank, each a head range of the same
    slabs: merged, one chunk carries the rank's whole slabs (no strided copy before the send; sent from
    the cache as it lies), and the receiver puts each head range into the rank that holds it. The units
    the plan checked stay covered exactly once: a merged chunk carries the same (layer, head, block) pieces.
    """
    out: list[ChunkPlan] = []
    for c in chunks:
        prev = out[-1] if out else None
        if (prev is not None and prev.num_heads and c.num_heads and prev.src_rank == c.src_rank
                and (prev.layer, prev.num_layers, prev.first_block, prev.num_blocks)
                == (c.layer, c.num_layers, c.first_block, c.num_blocks)
                and prev.src_head + prev.num_heads == c.src_head and prev.head_start + prev.num_heads == c.head_start
                and prev.num_layers * c.num_blocks * (bytes_per_block(prev) + bytes_per_block(c)) <= max_chunk_bytes):
            out[-1] = replace(prev, num_heads=prev.num_heads + c.num_heads)
        else:
            out.append(c)
    return out


def contiguous_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """``[(first_id, length)]`` covering block_ids in order, merging consecutive ids."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


class Coverage:
    """Which (layer, global KV head, block index) pieces of a transfer have landed; duplicates count once.

    Heads are the model's (all ranks together): a transfer is complete when every head of every layer of
    every block landed, which is when each decode rank has all of its own."""

    def __init__(self, num_layers: int, num_blocks: int, num_heads: int = 1):
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.num_heads = num_heads
        self._bits = bytearray(num_layers * num_heads * num_blocks)  # [layer][head][block]
        self.num_covered = 0

    def add(self, layer: int, first_block: int, num_blocks: int, head_start: int = 0,
            num_heads: int | None = None) -> None:
        """num_heads None: every head."""
        for head in range(head_start, head_start + (self.num_heads if num_heads is None else num_heads)):
            lo = (layer * self.num_heads + head) * self.num_blocks + first_block
            hi = lo + num_blocks
            self.num_covered += num_blocks - sum(self._bits[lo:hi])
            self._bits[lo:hi] = b"\x01" * num_blocks

    @property
    def is_complete(self) -> bool:
        return self.num_covered == len(self._bits)

    def missing_layers(self) -> list[int]:
        per_layer = self.num_heads * self.num_blocks
        return [l for l in range(self.num_layers) if sum(self._bits[l * per_layer:(l + 1) * per_layer]) < per_layer]

    def check_range(self, layer: int, first_block: int, num_blocks: int, head_start: int = 0,
                    num_heads: int | None = None) -> str | None:
        """An error message when the range is outside the transfer, else None."""
        if not 0 <= layer < self.num_layers:
            return f"layer {layer} out of range [0, {self.num_layers})"
        if num_blocks <= 0 or first_block < 0 or first_block + num_blocks > self.num_blocks:
            return f"blocks [{first_block}, {first_block + num_blocks}) out of range [0, {self.num_blocks})"
        num_heads = self.num_heads if num_heads is None else num_heads
        if num_heads <= 0 or head_start < 0 or head_start + num_heads > self.num_heads:
            return f"kv-heads [{head_start}, {head_start + num_heads}) out of range [0, {self.num_heads})"
        return None
