"""engine.bench: the BENCHMARKS.md section rewrite, and a run end to end on a tiny model."""
from __future__ import annotations

import re

import pytest

from engine.bench import main, torch_capability
from engine.benchmarks_md import replace_section
from tests.engine.factories import save_tiny_model

NEW = "## Engine\n\nnew table\n"


def test_replace_section_keeps_the_other_sections():
    text = "# Benchmarks\n\n## Serving\n\nserving figures\n\n## Engine\n\nold table\nmore\n\n## Transfer\n\nt\n"
    out = replace_section(text, NEW)
    assert out == "# Benchmarks\n\n## Serving\n\nserving figures\n\n## Engine\n\nnew table\n\n## Transfer\n\nt\n"
    assert replace_section(out, NEW) == out
    last = replace_section("# B\n\n## Engine\n\nold\n### sub\nold too\n", NEW)
    assert last == "# B\n\n## Engine\n\nnew table\n"
    assert replace_section("# B\n\n## Serving\n\nx\n", NEW) == "# B\n\n## Serving\n\nx\n\n## Engine\n\nnew table\n"
    assert replace_section("", NEW) == "# Benchmarks\n\n## Engine\n\nnew table\n"
    assert replace_section("## Engines\n", NEW).startswith("## Engines\n\n## Engine\n")


def test_bench_runs_end_to_end_on_a_tiny_model(tmp_path, capsys):
    save_tiny_model(tmp_path / "m")
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\n## Serving\n\nkeep me\n")
    args = ["--model", str(tmp_path / "m"), "--dtype", "float32", "--prompt-len", "8",
            "--new-tokens", "4", "--batch", "2", "--write", "--benchmarks-file", str(md)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert sum(line.startswith("| ") for line in out.splitlines()) == 6 + 7
    assert "kernel ISA path: torch ops" in out  # float32: torch's ops
    # the baseline names what torch ran on; no avx2 path here, so no second, AVX2-held baseline
    assert f"| metric | kvrelay | transformers (torch {torch_capability()}) | ratio |" in out
    assert "| part of one single-stream decode step | ms |" in out
    step = re.search(r"\| whole step \| ([\d.]+) ", out)
    assert step and float(step.group(1)) > 0
    text = md.read_text()
    assert "keep me" in text and "## Engine" in text and "- Command: `python -m engine.bench" in text
    assert re.search(r"- Machine: `nproc` \d+, .*torch ", text)
    assert main(["--model", str(tmp_path / "m"), "--dtype", "float32", "--prompt-len", "8",
                 "--profile", str(tmp_path / "prof")]) == 0
    assert (tmp_path / "prof" / "engine_decode_trace.json").stat().st_size > 0
    assert "Self CPU" in capsys.readouterr().out


def test_cli_has_bench_engine():
    from cluster.cli import build_parser

    args = build_parser().parse_args(["bench-engine", "--dtype", "float32", "--batch", "4"])
    assert (args.command, args.dtype, args.batch, args.new_tokens) == ("bench-engine", "float32", 4, 128)


def test_rounds_interleave_the_runs_and_give_each_rounds_ratio(tmp_path, capsys):
    """--rounds 2 with two weight formats: every run twice, medians in the table, and
    every round's single-stream figure and same-round int8 / bf16 ratio listed."""
    save_tiny_model(tmp_path / "m")
    args = ["--model", str(tmp_path / "m"), "--dtype", "bfloat16", "--quantization", "none,int8",
            "--prompt-len", "8", "--new-tokens", "4", "--batch", "2", "--rounds", "2"]
    assert main(args) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "medians of 2 interleaved rounds" in out
    runs = re.findall(r"^- (bfloat16|int8) (\S+): ([\d.]+), ([\d.]+)$", out, flags=re.M)
    assert sorted(r[0] for r in runs) == ["bfloat16", "int8"], out
    (path,) = {r[1] for r in runs}
    ratio = re.search(rf"^- int8 {path} / bfloat16 {path}, same round: ([\d.]+)x, ([\d.]+)x \(median ([\d.]+)x\)$",
                      out, flags=re.M)
    assert ratio, out
    fig = {r[0]: (float(r[2]), float(r[3])) for r in runs}
    assert abs(float(ratio.group(1)) - fig["int8"][0] / fig["bfloat16"][0]) < 0.01
    # the interleaving: round 1 of both runs before round 2 of either
    order = re.findall(r"kvrelay \(m, (\S+ \S+)\) round (\d)/2", captured.err)
    assert [r for _, r in order] == ["1", "1", "2", "2"], order
    with pytest.raises(SystemExit, match="--rounds must be at least 1"):
        main(args[:-2] + ["--rounds", "0"])
