"""engine.hugepages.pack: same values, tied weights stay tied, and the arena
is backed by huge pages where the kernel offers them."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.hugepages import HUGE_PAGE, pack, zeros

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _anon_huge_kb(addr: int) -> int:
    """AnonHugePages of the mapping that holds `addr` in this process."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_pack_keeps_values_and_ties():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(1024, 1024, generator=g).bfloat16()  # 2 MiB
    b = torch.randn(3, 577, generator=g)
    c = torch.randn(700, 900, generator=g).bfloat16()
    out = pack([a, b, a, c])
    assert out[0] is out[2]  # tied weights (embedding / LM head) stay one tensor
    for got, want in zip(out, [a, b, a, c]):
        assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
        assert torch.equal(got, want)
        assert got.data_ptr() % 64 == 0
    small = [torch.ones(10)]
    assert pack(small)[0] is small[0]  # under one huge page: left alone


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages")
def test_pack_lands_in_huge_pages():
    ts = pack([torch.ones(4 * HUGE_PAGE // 2, dtype=torch.bfloat16)])
    assert ts[0].data_ptr() % HUGE_PAGE == 0
    assert _anon_huge_kb(ts[0].data_ptr()) >= 2048


def test_zeros_are_zero_and_apart():
    a, b = zeros([(300, 2, 16, 3, 64), (300, 2, 16, 3, 64)], torch.bfloat16) or pytest.skip("no huge pages")
    assert a.shape == (300, 2, 16, 3, 64) and a.is_contiguous() and not a.any() and not b.any()
    a.fill_(1)
    assert not b.any()  # no overlap


def _process_rss_mb() -> float:
    """This process's resident memory: what is actually backed."""
    import os

    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages")
def test_kv_cache_is_backed_at_start_only_when_prefaulted():
    """Fresh KV cache memory is backed page by page on first write; prefault=True (what served replicas
    use) writes it all at allocation, so the memory is committed, and a cache too large fails, at start."""
    from engine.kv_cache import KVCacheSpec, allocate_kv_cache

    spec = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")
    num_blocks = (64 << 20) // spec.bytes_per_block  # 64 MiB in all
    before = _process_rss_mb()
    lazy = allocate_kv_cache(spec, num_blocks)
    assert _process_rss_mb() - before < 16  # nothing written yet: (almost) nothing backed
    before = _process_rss_mb()
    eager = allocate_kv_cache(spec, num_blocks, prefault=True)
    assert _process_rss_mb() - before > 56
    assert all(not layer.any() for layer in eager + lazy)  # zeros either way
