"""The shapes CUDA graphs are captured for (the capture itself: tests/gpu)."""
from __future__ import annotations

from engine.cuda_graph import BATCH_BUCKETS, batch_bucket, width_bucket


def test_batch_bucket_is_the_smallest_that_holds_the_batch():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 16, 17, 256)] == [1, 2, 4, 8, 16, 24, 256]
    assert batch_bucket(BATCH_BUCKETS[-1] + 1) is None
    assert all(batch_bucket(n) >= n for n in range(1, 257))


def test_width_bucket_is_a_power_of_two_capped_at_the_context():
    assert [width_bucket(n, 128) for n in (1, 2, 3, 9, 64, 65, 128)] == [1, 2, 4, 16, 64, 128, 128]
    assert width_bucket(100, 100) == 100  # never wider than a sequence can be
