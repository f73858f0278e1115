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
