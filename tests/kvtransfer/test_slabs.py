"""slabs.scatter/gather move exactly the named slabs, for contiguous and scattered block ids."""
from __future__ import annotations

import random

import pytest
import torch

from kvtransfer import slabs


def make_layers(num_layers: int, num_blocks: int, slab: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (num_blocks, slab), dtype=torch.uint8, generator=g) for _ in range(num_layers)]


@pytest.mark.parametrize("ids", [[4, 5, 6, 7], [9, 2, 3, 0, 7], [5]])
@pytest.mark.parametrize("num_layers", [1, 3])
def test_gather_then_scatter_moves_exactly_the_named_slabs(ids, num_layers):
    src = make_layers(4, 12, 32, seed=1)
    dst = make_layers(4, 12, 32, seed=2)
    before = [d.clone() for d in dst]
    layers = range(1, 1 + num_layers)
    flat = slabs.gather(src, layers, ids)  # [layers * n, slab]
    assert torch.equal(flat, torch.cat([src[layer][ids] for layer in layers]))
    targets = random.Random(0).sample(range(12), len(ids))
    for i, layer in enumerate(layers):
        slabs.scatter(dst[layer], targets, flat.view(num_layers, len(ids), -1)[i])
    for layer in range(4):
        expected = before[layer].clone()
        if layer in layers:
            expected[targets] = src[layer][ids]
        assert torch.equal(dst[layer], expected)


def test_gather_into_a_given_buffer_and_as_a_view():
    src = make_layers(2, 8, 16, seed=3)
    out = torch.empty(2 * 3 * 16, dtype=torch.uint8)
    flat = slabs.gather(src, range(2), [6, 1, 2], out=out)
    assert flat.data_ptr() == out.data_ptr()
    view = slabs.gather(src, range(1, 2), [2, 3, 4])
    assert view.data_ptr() == src[1][2].data_ptr()


@pytest.mark.parametrize("ids", [[4, 5, 6, 7], [9, 2, 3, 0, 7], [5]])
@pytest.mark.parametrize("heads", [(0, 1), (1, 2), (2, 1), (0, 3)])
def test_a_head_range_moves_between_heads_inner_caches(ids, heads):
    """gather_heads reads local heads [h, h + k) of each block ([blocks, 2, block_size, heads, head_dim]);
    scatter_heads writes them at another offset of another rank's cache, touching nothing else."""
    head, k = heads
    g = torch.Generator().manual_seed(3)
    src = [torch.randn(12, 2, 4, 3, 8, generator=g).to(torch.bfloat16) for _ in range(2)]
    dst = [torch.randn(12, 2, 4, 5, 8, generator=g).to(torch.bfloat16) for _ in range(2)]
    before = [d.clone() for d in dst]
    flat = slabs.gather_heads(slabs.head_views(src), range(0, 2), ids, head, k)  # [layers * n, bytes per block]
    want = torch.stack([src[layer][ids][:, :, :, head:head + k] for layer in range(2)])
    assert torch.equal(flat.view(torch.bfloat16).view(want.shape), want)
    targets = random.Random(1).sample(range(12), len(ids))
    hv = slabs.head_views(dst)
    for layer in range(2):
        part = flat.view(2, len(ids), 8, k, -1)[layer]  # [blocks, rows, heads, head_bytes]
        slabs.scatter_heads(hv[layer], targets, 2, part)
    for layer in range(2):
        expected = before[layer].clone()
        expected[targets, :, :, 2:2 + k] = src[layer][ids][:, :, :, head:head + k]
        assert torch.equal(dst[layer], expected)
