"""The planner is plain Python: chunking, runs and coverage, checked as properties."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvtransfer.planner import ChunkPlan, Coverage, coalesce_layers, contiguous_runs, merge_heads, plan_layer


@given(num_blocks=st.integers(1, 300), slab=st.integers(1, 10_000), cap=st.integers(1, 100_000))
def test_chunks_cover_the_layer_once_within_the_cap(num_blocks, slab, cap):
    chunks = plan_layer(3, num_blocks, slab, cap)
    covered = [i for c in chunks for i in range(c.first_block, c.first_block + c.num_blocks)]
    assert covered == list(range(num_blocks))
    assert all(c.layer == 3 and (c.num_blocks * slab <= cap or c.num_blocks == 1) for c in chunks)


@given(st.lists(st.integers(0, 50), max_size=60))
def test_runs_rebuild_the_ids_in_order(ids):
    runs = contiguous_runs(ids)
    assert [b + i for b, n in runs for i in range(n)] == ids
    assert all(a + n != b for (a, n), (b, _) in zip(runs, runs[1:]))


def test_coverage_counts_duplicates_once_and_names_missing_layers():
    cov = Coverage(num_layers=3, num_blocks=4)
    cov.add(0, 0, 4)
    cov.add(0, 1, 2)
    cov.add(2, 0, 4)
    assert cov.missing_layers() == [1] and not cov.is_complete
    cov.add(1, 0, 4)
    assert cov.is_complete
    assert "out of range" in cov.check_range(1, 3, 2)
    assert "out of range" in cov.check_range(3, 0, 1)
    assert cov.check_range(2, 0, 4) is None


@given(num_layers=st.integers(1, 40), num_blocks=st.integers(1, 20), cap=st.integers(1, 400))
def test_coalesced_chunks_cover_the_same_slabs_within_the_cap(num_layers, num_blocks, cap):
    slab = 10
    planned = [c for layer in range(num_layers) for c in plan_layer(layer, num_blocks, slab, cap)]
    merged = coalesce_layers(planned, slab, cap)
    def slabs(chunks):
        return sorted((l, b) for c in chunks for l in c.layers for b in range(c.first_block, c.first_block + c.num_blocks))
    assert slabs(merged) == slabs(planned)
    assert sum(c.num_layers for c in merged) == len(planned)
    assert all(c.num_layers == 1 or c.num_layers * c.num_blocks * slab <= cap for c in merged)


def _pieces(chunks):
    """Every (layer, global head, block) a list of chunks carries, with repeats."""
    return sorted((layer, h, b) for c in chunks for layer in c.layers for h in range(c.head_start, c.head_start + c.num_heads)
                  for b in range(c.first_block, c.first_block + c.num_blocks))


@given(num_blocks=st.integers(1, 40), heads_per_unit=st.integers(1, 4), units=st.integers(1, 4),
       num_src=st.integers(1, 2), cap=st.integers(1, 2_000))
def test_merged_head_ranges_carry_the_same_pieces_within_the_cap(num_blocks, heads_per_unit, units, num_src, cap):
    head_bytes = 10
    planned = []
    for u in range(units):  # a unit: heads_per_unit heads, of source rank u % num_src
        rank, first = u % num_src, u * heads_per_unit
        local = (u // num_src) * heads_per_unit
        planned += [ChunkPlan(0, c.first_block, c.num_blocks, 1, first, heads_per_unit, rank, local)
                    for c in plan_layer(0, num_blocks, heads_per_unit * head_bytes, cap)]
    planned.sort(key=lambda c: (c.src_rank, c.first_block, c.src_head))
    merged = merge_heads(planned, lambda c: c.num_heads * head_bytes, cap)
    assert _pieces(merged) == _pieces(planned)
    assert all(c in planned or c.num_blocks * c.num_heads * head_bytes <= cap for c in merged)
    assert len({(c.src_rank, c.src_head, c.first_block) for c in merged}) == len(merged)


def test_a_one_rank_prefill_to_tp2_sends_its_whole_slabs_as_one_chunk():
    # heads 0-1 to decode rank 0, 2-3 to decode rank 1, both from the one prefill rank's 4 heads
    units = [ChunkPlan(5, 0, 8, 1, 0, 2, 0, 0), ChunkPlan(5, 0, 8, 1, 2, 2, 0, 2)]
    assert merge_heads(units, lambda c: c.num_heads * 10, 8 * 40) == [ChunkPlan(5, 0, 8, 1, 0, 4, 0, 0)]
    assert merge_heads(units, lambda c: c.num_heads * 10, 8 * 40 - 1) == units  # over the cap: as planned
    # two prefill ranks (2 -> 1): different sources, never one chunk
    two = [ChunkPlan(5, 0, 8, 1, 0, 2, 0, 0), ChunkPlan(5, 0, 8, 1, 2, 2, 1, 0)]
    assert merge_heads(two, lambda c: c.num_heads * 10, 1 << 20) == two
