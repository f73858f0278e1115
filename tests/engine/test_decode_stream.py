"""How bf16 matmuls of decode rows stream their weights (engine/csrc/matmul_bf16.cpp,
`set_bf16_decode_stream`): every setting gives the same bits, a bad one is refused by name, and
engine.decode_stream_bench compares them. Each test runs once per kernel ISA path the CPU runs."""
from __future__ import annotations

import itertools
import re

import pytest
import torch

from engine.kernels import PackedWeight, load_native_ops
from tests.engine.factories import rand_bf16


def _tile_rows(ext) -> int:
    """The rows of one register tile on ext's path: the decode rows the stream setting applies to."""
    return 6 if ext.isa == "avx2" else 12


@pytest.fixture
def decode_stream(native):
    """The bf16 decode stream setting of `native`'s module, put back to the default afterwards."""
    default = native.ext.bf16_decode_stream()
    # one run of blocks a thread; the next block fetched in software from some rows on, within one tile,
    # and below those rows nothing or the own stream at most 1 KiB ahead (2 KiB and more lose on every
    # CPU measured, BENCHMARKS.md)
    assert default == native.ext.default_bf16_decode_stream()
    assert default[0] == 1 and 1 < default[1] <= _tile_rows(native.ext) and default[2] in (0, 256, 512, 1024)
    yield native.ext
    native.ext.set_bf16_decode_stream(*default)


@pytest.mark.parametrize("m", [1, 3, 6, 12, 13])
def test_every_decode_stream_setting_gives_the_same_bits(native, decode_stream, m):
    """How a thread streams its blocks (chunks a thread; the next block, or its own stream some bytes
    ahead, prefetched) never changes a result. The setting applies to decode rows, up to one
    register tile (6 rows on avx2, 12 on AVX-512); 13 rows are past it on every path."""
    w = PackedWeight.pack(rand_bf16(333, 576, seed=7))
    x = rand_bf16(m, 576, seed=8)
    ref = {t: native.ext.linear_packed(x, w.data, w.n, f32_out=True, threads=t) for t in (1, 2)}
    assert torch.equal(ref[1], ref[2])
    for setting in [(4, 0, 0), (1, 1, 0), (4, 1, 0), (2, 0, 0), (64, 1, 0), (1, 3, 0), (1, 6, 0), (1, 0, 64),
                    (1, 0, 4096), (3, 0, 1 << 20), (1, 2, 1024), (4, 6, 64), (1, 1, 4096)]:
        decode_stream.set_bf16_decode_stream(*setting)
        assert decode_stream.bf16_decode_stream() == setting
        for t in (1, 2):
            assert torch.equal(native.ext.linear_packed(x, w.data, w.n, f32_out=True, threads=t), ref[t]), (setting, t)


def test_a_bad_decode_stream_setting_is_refused_by_name(native, decode_stream):
    default = decode_stream.bf16_decode_stream()
    for bad in (0, 65):
        with pytest.raises(RuntimeError, match=f"chunks_per_thread must be 1 to 64, not {bad}"):
            decode_stream.set_bf16_decode_stream(bad, 0)
    tile = _tile_rows(native.ext)
    for bad in (-1, tile + 1):
        with pytest.raises(RuntimeError, match=rf"prefetch_next_from must be 0 \(never\) to {tile} \(the rows of "
                                               rf"one tile\), not {bad}"):
            decode_stream.set_bf16_decode_stream(1, bad)
    for bad in (-64, 100, (1 << 20) + 64):
        with pytest.raises(RuntimeError, match=f"prefetch_ahead must be a multiple of 64 bytes from 0 to 1048576, "
                                               f"not {bad}"):
            decode_stream.set_bf16_decode_stream(1, 0, bad)
    assert decode_stream.bf16_decode_stream() == default


def test_decode_stream_bench_compares_every_setting(tmp_path, kernel_isa, monkeypatch, capsys):
    """python -m engine.decode_stream_bench on a tiny model: every setting's tokens/s, its ratio to
    the default within each round, the same greedy tokens, in its own section; the default is
    restored after."""
    from engine import benchmarks_md, decode_stream_bench
    from tests.engine.factories import save_tiny_model

    save_tiny_model(tmp_path / "m", "llama")
    md = tmp_path / "BENCHMARKS.md"
    write = benchmarks_md.write_section
    monkeypatch.setattr(benchmarks_md, "write_section", lambda text: write(text, md))
    assert decode_stream_bench.main(["--model", str(tmp_path / "m"), "--isa", kernel_isa, "--threads", "1,2",
                                     "--rounds", "2", "--prompt-len", "16", "--new-tokens", "8", "--ahead", "512,8192",
                                     "--batch", "1,3", "--write"]) == 0
    text = md.read_text()
    assert text.count(decode_stream_bench.SECTION) == 1 and "the same under every setting" in text
    default = load_native_ops(kernel_isa).default_bf16_decode_stream()
    every = decode_stream_bench.settings(default, (512, 8192))
    # the default, four chunks, no prefetch, the next block at any rows, and the default's next-block
    # rows with each distance below them (and with none, where the default has one)
    assert every[0].label.startswith("default") and (every[0].prefetch_next_from, every[0].prefetch_ahead) == \
        default[1:]
    assert {(s.prefetch_next_from, s.prefetch_ahead) for s in every[2:]} == \
        {(0, 0), (1, 0)} | {(default[1], a) for a in {0, 512, 8192} - {default[2]}}
    assert len({s.label for s in every}) == len(every)
    for t, b in itertools.product((1, 2), (1, 3)):
        for s in every:
            row = re.search(rf"^\| {kernel_isa} \| {t} \| {b} \| {re.escape(s.label)} \| ([\d.]+) \| \d+% \| "
                            rf"([\d.]+), ([\d.]+) \| \*\*([\d.]+)x\*\* \|$", text, re.M)
            assert row and all(float(g) > 0 for g in row.groups()), (t, b, s, text)
            if s == every[0]:
                assert row.groups()[1:] == ("1.00", "1.00", "1.00")
    assert load_native_ops(kernel_isa).bf16_decode_stream() == default
    with pytest.raises(SystemExit, match="--ahead 100: a prefetch distance must be a multiple of 64"):
        decode_stream_bench.main(["--model", str(tmp_path / "m"), "--isa", kernel_isa, "--ahead", "4096,100"])
    with pytest.raises(SystemExit, match="--batch 4,13: each batch must be 1 to 12 sequences"):
        decode_stream_bench.main(["--model", str(tmp_path / "m"), "--isa", kernel_isa, "--batch", "4,13"])
    with pytest.raises(SystemExit):
        decode_stream_bench.main(["--model", str(tmp_path / "m"), "--isa", kernel_isa, "--section", "bf16 decode"])
    assert "--section: 'bf16 decode': a BENCHMARKS.md section heading starts with '## '" in capsys.readouterr().err
