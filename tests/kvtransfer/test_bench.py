"""kvtransfer.bench --write: the section names each target's verdict from the run's own figures."""
from __future__ import annotations

from types import SimpleNamespace

from engine.benchmarks_md import replace_section
from kvtransfer import bench


def test_section_reads_targets_against_the_socket_of_the_same_run():
    rows = [("socket (bound)", 4096, 0.030, 0.1), ("grpc", 4096, 0.050, 0.2), ("nccl", 4096, 0.045, 0.2)]
    ratios = {("socket (bound)", 4096): [100.0], ("grpc", 4096): [55.0, 65.0], ("nccl", 4096): [60.0, 70.0]}
    overlap = [("grpc", "sleep", 0.032, 0.002)]
    text = bench.section(SimpleNamespace(reps=2), rows, ratios, overlap, "python -m kvtransfer.bench --write")
    assert text.startswith("## KV transfer\n")
    assert "| grpc | 4096 | 94.4 | 50.0 | 1.89 | 60% | 55–65% | 200.0 |" in text
    assert "**met**: 60% (rounds 55–65%)" in text  # grpc >= 50%
    assert "**not met**: 67% (rounds 60–70%)" in text  # nccl >= 70%
    assert "**met**: worst 6.2%" in text
    doc = "# Benchmarks\n\n## KV transfer\n\nold\n\n## Engine\n\nkept\n"
    assert replace_section(doc, text).endswith("## Engine\n\nkept\n")


def test_tp_section_reads_the_target_against_the_homogeneous_pair_of_the_same_run():
    from kvtransfer import bench_tp

    seconds = {("nccl", 4096, 1, 1): 0.080, ("nccl", 4096, 2, 1): 0.090, ("nccl", 4096, 1, 2): 0.110}
    ratios = {key: [100 * 0.080 / sec] for key, sec in seconds.items()}
    copies = [("gather, whole blocks (contiguous slabs)", 4_000_000, 0.001)]
    text = bench_tp.section(SimpleNamespace(reps=1, copy_tokens=4096), copies, seconds, ratios,
                            "python -m kvtransfer.bench_tp")
    assert text.startswith("## Heterogeneous TP KV transfer\n")
    assert "| gather, whole blocks (contiguous slabs) | 4.00 | 1.000 | 4.00 |" in text
    assert "| nccl | 4096 | 125.8 | 2 -> 1 | 90.0 | 1.40 | 89% | 89–89% |" in text
    assert "**not met**: worst pair 73%" in text  # 1 -> 2 at 80 / 110


def test_pp_section_gives_each_prefill_rank_its_time_to_landed():
    from kvtransfer import bench_pp

    results = {("grpc", 1024, (1, 1), 1): ([0.004], [0.004], 0.005),
               ("grpc", 1024, (2, 2), 1): ([0.003, 0.004, 0.006, 0.007], [-0.010, -0.009, 0.006, 0.007], 0.008)}
    text = bench_pp.section(SimpleNamespace(reps=3, layer_ms=1.0), results, "python -m kvtransfer.bench_pp")
    assert text.startswith("## Pipeline-parallel KV hand-off\n")
    assert "| grpc | 1024 | 31.5 | TP=1 -> TP=1 | 4.0 | +4.0 | 5.0 |" in text
    assert "| grpc | 1024 | 31.5 | PP=2 x TP=2 -> TP=1 | 3.0 / 4.0 / 6.0 / 7.0 | -10.0 / -9.0 / +6.0 / +7.0 | 8.0 |" \
        in text
