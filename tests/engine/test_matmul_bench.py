"""engine.matmul_bench: kvrelay's packed bf16 matmul against torch's fp32 SGEMM, row count by row
count, written to its own section."""
from __future__ import annotations

import re

import pytest


def test_the_matmul_bench_writes_a_row_per_matrix_and_row_count(tmp_path, monkeypatch, kernel_isa):
    from engine import benchmarks_md, matmul_bench

    md = tmp_path / "BENCHMARKS.md"
    write = benchmarks_md.write_section
    monkeypatch.setattr(benchmarks_md, "write_section", lambda text: write(text, md))
    monkeypatch.setattr(matmul_bench, "SHAPES", {"o": (576, 576), "odd": (37, 64)})
    assert matmul_bench.main(["--isa", kernel_isa, "--rows", "1,7,40", "--rounds", "1", "--write"]) == 0
    text = md.read_text()
    assert text.count(matmul_bench.SECTION) == 1
    for name, (n, k) in matmul_bench.SHAPES.items():
        for m in (1, 7, 40):
            row = re.search(rf"^\| {kernel_isa} \| 1 \| {name} {n} x {k} \| {m} \| (\d+) \| (\d+) \| "
                            rf"\*\*([\d.]+)x\*\* \|$", text, re.M)
            assert row and float(row[3]) > 0, (name, m, text)
    with pytest.raises(SystemExit, match="--rows 8,0: each must be a positive number of rows"):
        matmul_bench.main(["--isa", kernel_isa, "--rows", "8,0"])
