"""Transfer planning: which blocks of which layer go in which message. Plain Python.

A transfer moves, for every layer, the slabs ``kv[layer][src_block_ids[i]]``
into ``kv[layer][dst_block_ids[i]]``. The planner cuts each layer into chunks
of at most ``max_chunk_bytes`` (a chunk names a range of *indices* into the
ticket's block list, never raw block ids: the receiver maps indices to its own
blocks), and finds runs of consecutive block ids so a mover copies runs rather
than single slabs.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkPlan:
    """Slabs of layers ``[layer, layer + num_layers)`` x ticket blocks ``[first_block, +num_blocks)``."""

    layer: int
    first_block: int  # index into the ticket's block list
    num_blocks: int
    num_layers: int = 1

    @property
    def layers(self) -> range:
        return range(self.layer, self.layer + self.num_layers)


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    if num_tokens <= 0:
        raise ValueError(f"num_tokens must be > 0, got {num_tokens}")
    return -(-num_tokens // block_size)


def plan_layer(layer: int, num_blocks: int, bytes_per_block: int, max_chunk_bytes: int) -> list[ChunkPlan]:
    """The chunks of one layer, in block order, each at most max_chunk_bytes (at least one block)."""
    per_chunk = max(1, max_chunk_bytes // max(1, bytes_per_block))
    return [ChunkPlan(layer, start, min(per_chunk, num_blocks - start))
            for start in range(0, num_blocks, per_chunk)]


def coalesce_layers(chunks: list[ChunkPlan], bytes_per_block: int, max_chunk_bytes: int) -> list[ChunkPlan]:
    """Merge whole-layer chunks of consecutive layers (same block range) up to max_chunk_bytes.

    Used when the sender has fallen behind the per-layer hook: several small
    layers then travel as one message instead of one message each.
    """
    out: list[ChunkPlan] = []
    for c in chunks:
        prev = out[-1] if out else None
        if (prev is not None and prev.layer + prev.num_layers == c.layer and c.num_layers == 1
                and (prev.first_block, prev.num_blocks) == (c.first_block, c.num_blocks)
                and (prev.num_layers + 1) * c.num_blocks * bytes_per_block <= max_chunk_bytes):
            out[-1] = ChunkPlan(prev.layer, prev.first_block, prev.num_blocks, prev.num_layers + 1)
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
    """Which (layer, block index) slabs of a transfer have landed; duplicates count once."""

    def __init__(self, num_layers: int, num_blocks: int):
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self._bits = bytearray(num_layers * num_blocks)
        self.num_covered = 0

    def add(self, layer: int, first_block: int, num_blocks: int) -> None:
        lo = layer * self.num_blocks + first_block
        hi = lo + num_blocks
        self.num_covered += num_blocks - sum(self._bits[lo:hi])
        self._bits[lo:hi] = b"\x01" * num_blocks

    @property
    def is_complete(self) -> bool:
        return self.num_covered == self.num_layers * self.num_blocks

    def missing_layers(self) -> list[int]:
        nb = self.num_blocks
        return [l for l in range(self.num_layers) if sum(self._bits[l * nb:(l + 1) * nb]) < nb]

    def check_range(self, layer: int, first_block: int, num_blocks: int) -> str | None:
        """An error message when the range is outside the transfer, else None."""
        if not 0 <= layer < self.num_layers:
            return f"layer {layer} out of range [0, {self.num_layers})"
        if num_blocks <= 0 or first_block < 0 or first_block + num_blocks > self.num_blocks:
            return f"blocks [{first_block}, {first_block + num_blocks}) out of range [0, {self.num_blocks})"
        return None
