"""The logits gather on the shared segment (`ShmGroup.gather_vocab`), between real rank processes:
several gathers back to back (a step that scores prompt positions gathers their logits, then the
sampled rows'), each larger than a rank's slot so it goes in row chunks, with rank 0 slow to read.
No rank may write its slot again before rank 0 read what it held: every row comes from its own
gather and rank."""
from __future__ import annotations

import time

import pytest
import torch

from engine.parallel.shm import SegmentLayout, ShmGroup, create_segment, unlink_segment
from tests.engine.factories import run_ranks

VOCAB_SHARD = 16
ROWS = [3, 40, 1, 64]  # a rank's slot holds 16 rows of 16 float32 (1 kB): 40 and 64 go in chunks


def shard(gather: int, rank: int, n: int) -> torch.Tensor:
    """Rank `rank`'s vocabulary slice of gather `gather`'s n rows: each value names all three."""
    return gather * 1000 + rank * 100 + torch.arange(n, dtype=torch.float32)[:, None] + \
        torch.arange(VOCAB_SHARD) / 32


def _rank(rank: int, results, where: str, layout) -> None:
    torch.set_num_threads(1)
    comm = ShmGroup(where, layout, rank, 30.0)
    out = []
    for g, n in enumerate(ROWS):
        if rank == 0:
            time.sleep(0.2)  # the others are ahead: their next gather's rows are ready to overwrite this one's
        got = comm.gather_vocab(shard(g, rank, n))
        out.append(None if got is None else got.tolist())
    results.put((rank, out))


@pytest.mark.parametrize("size", [2, 3])
def test_back_to_back_gathers_keep_every_ranks_rows(size):
    layout = SegmentLayout.make(size, 4096, 16 * VOCAB_SHARD * 4, 4096)
    where = create_segment(layout)
    try:
        out = run_ranks(_rank, size, where, layout)
    finally:
        unlink_segment(where)
    for g, n in enumerate(ROWS):
        want = torch.cat([shard(g, r, n) for r in range(size)], dim=1)
        assert out[0][g] == want.tolist(), f"gather {g} of {n} rows"
        assert all(out[r][g] is None for r in range(1, size))
