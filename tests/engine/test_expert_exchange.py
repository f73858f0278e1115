"""The exchanges of the ``alltoall`` expert dispatch (engine/parallel/moe.py), between real rank
processes: `all_to_all` with uneven split sizes (zeros included) and `all_gather` of uneven row
counts, on the shared segment (windows smaller than the data, so rows cross in several rounds,
interleaved with all-reduces on the same slots) and on gloo; a rank that never arrives makes the
others fail within the timeout, naming the exchange."""
from __future__ import annotations

import time

import pytest
import torch

from engine.parallel.comm import CollectiveError, GlooCollectives, row_splits
from engine.parallel.group import _free_port
from engine.parallel.shm import SegmentLayout, ShmGroup, create_segment, unlink_segment
from tests.engine.factories import run_ranks

H = 8
# splits[s][d]: rows rank s sends rank d; 1000 rows of fp32 [8] are 32 kB, eight 4 kB windows
SPLITS = {2: [[3, 1000], [0, 0]], 3: [[0, 5, 700], [3, 0, 0], [1000, 2, 1]]}
GATHER_ROWS = {2: [0, 1300], 3: [3, 0, 1500]}


def rows_for(s: int, d: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank s's n rows for rank d: each row names its source, destination and place."""
    i = torch.arange(n, dtype=torch.float32).unsqueeze(1)
    return (s * 10000 + d * 1000 + i % 1000 + torch.arange(H) / 16).to(dtype)


def _rank(rank: int, results, backend: str, size: int, where: str, layout, dtype) -> None:
    torch.set_num_threads(1)
    comm = (ShmGroup(where, layout, rank, 30.0) if backend == "shm"
            else GlooCollectives(rank, size, where, 30.0))
    splits = SPLITS[size]
    send = torch.cat([rows_for(rank, d, splits[rank][d], dtype) for d in range(size)])
    total = comm.all_reduce(torch.ones(4))  # the same slots and generations as the exchanges
    got = comm.all_to_all(send, splits)
    total = comm.all_reduce(total)
    mine = rows_for(rank, rank, GATHER_ROWS[size][rank], dtype)
    gathered = comm.all_gather(mine, GATHER_ROWS[size])
    counts = comm.all_gather(torch.tensor([[rank, 7 * rank]]), [1] * size)
    results.put((rank, (str(got.dtype), got.float().tolist(), gathered.float().tolist(), counts.tolist(),
                        total.tolist())))
    if backend == "gloo":
        comm.close()


@pytest.mark.parametrize("backend, size, dtype", [
    ("shm", 2, torch.float32), ("shm", 3, torch.float32), ("shm", 2, torch.bfloat16),
    ("gloo", 2, torch.float32), ("gloo", 3, torch.float32), ("gloo", 2, torch.bfloat16)])
def test_all_to_all_and_all_gather_move_uneven_rows(backend, size, dtype):
    layout = SegmentLayout.make(size, 4096, 4096, 4096)
    where = create_segment(layout) if backend == "shm" else f"tcp://127.0.0.1:{_free_port()}"
    try:
        out = run_ranks(_rank, size, backend, size, where, layout, dtype)
    finally:
        if backend == "shm":
            unlink_segment(where)
    splits, gather_rows = SPLITS[size], GATHER_ROWS[size]
    whole = torch.cat([rows_for(r, r, gather_rows[r], dtype) for r in range(size)])
    for d in range(size):
        got_dtype, got, gathered, counts, total = out[d]
        want = torch.cat([rows_for(s, d, splits[s][d], dtype) for s in range(size)])
        assert got_dtype == str(dtype) and got == want.float().tolist(), f"rank {d}: the rows sent to it"
        assert gathered == whole.float().tolist(), f"rank {d}: the all-gather"
        assert counts == [[r, 7 * r] for r in range(size)]
        assert total == [size * size] * 4


def test_a_rank_that_never_arrives_fails_the_exchange_in_time():
    layout = SegmentLayout.make(2, 4096, 4096, 4096)
    path = create_segment(layout)
    try:
        comm = ShmGroup(path, layout, 0, timeout_s=1.0)
        t0 = time.monotonic()
        with pytest.raises(CollectiveError, match="tensor-parallel all-to-all: rank 0 waited"):
            comm.all_to_all(torch.ones(3, H), [[1, 2], [0, 4]])
        assert time.monotonic() - t0 < 10
        comm.close()
    finally:
        unlink_segment(path)


def test_row_splits_are_contiguous_and_cover_every_row():
    assert row_splits(5, 2) == [3, 2]
    assert row_splits(1, 3) == [1, 0, 0]  # fewer tokens than ranks: some slices are empty
    assert row_splits(0, 2) == [0, 0]
