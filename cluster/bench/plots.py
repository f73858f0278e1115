"""PNG plots of a results.json dict (matplotlib, Agg backend: no display needed).

    ttft_cdf.png          TTFT CDF, one line per rate (successful requests)
    itl_cdf.png           ITL CDF, one line per rate
    goodput_vs_rate.png   goodput and request throughput against offered rate   (sweeps only)
    p99_itl_vs_rate.png   p99 ITL against offered rate                          (sweeps only)

The rate plots need two or more finite rates; an ``inf`` rate has no place
on the axis and is left out of them.
"""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from cluster.bench.report import rate_from_json  # noqa: E402
from cluster.bench.runner import rate_name  # noqa: E402


def _title(data: dict, what: str) -> str:
    return f"{what} - {data['label']}" if data.get("label") else what


def _cdf(data: dict, path: Path, what: str, values_ms) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for run in data["runs"]:
        xs = sorted(values_ms(run["requests"]))
        if xs:
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", label=f"{rate_name(rate_from_json(run['request_rate']))} req/s")
    ax.set_xlabel(f"{what} (ms)")
    ax.set_ylabel("fraction of requests" if what == "TTFT" else "fraction of token gaps")
    ax.set_ylim(0, 1.02)
    ax.set_title(_title(data, f"{what} CDF"))
    ax.grid(alpha=0.3)
    if ax.has_data():
        ax.legend(title="offered rate")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _against_rate(data: dict, path: Path, title: str, ylabel: str, series: dict[str, list[tuple[float, float]]]
                  ) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for (name, points), style in zip(series.items(), ("-o", "--s")):  # dashed: visible when the lines overlap
        ax.plot([x for x, _ in points], [y for _, y in points], style, label=name)
    ax.set_xlabel("offered request rate (req/s)")
    ax.set_ylabel(ylabel)
    ax.set_title(_title(data, title))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_plots(data: dict, out_dir: str | Path) -> list[Path]:
    """Write the plots of ``data`` into ``out_dir``; returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "ttft_cdf.png", out / "itl_cdf.png"]
    ok = lambda reqs: [r for r in reqs if r["is_ok"]]  # noqa: E731
    _cdf(data, written[0], "TTFT", lambda reqs: [r["ttft_s"] * 1000 for r in ok(reqs) if r["ttft_s"] is not None])
    _cdf(data, written[1], "ITL", lambda reqs: [g * 1000 for r in ok(reqs) for g in r["itls_s"]])

    finite = sorted((rate_from_json(r["request_rate"]), r["summary"]) for r in data["runs"]
                    if not math.isinf(rate_from_json(r["request_rate"])))
    if len(finite) >= 2:
        path = out / "goodput_vs_rate.png"
        _against_rate(data, path, "Goodput", "req/s", {
            "goodput (within SLOs)": [(r, s["goodput"]) for r, s in finite],
            "throughput (all completed)": [(r, s["request_throughput"]) for r, s in finite]})
        written.append(path)
        path = out / "p99_itl_vs_rate.png"
        _against_rate(data, path, "p99 inter-token latency", "ms", {
            "p99 ITL": [(r, s["itl_ms"]["p99"]) for r, s in finite if s["itl_ms"]["p99"] is not None]})
        written.append(path)
    return written
