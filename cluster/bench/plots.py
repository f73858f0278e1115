"""PNG plots of a results.json dict (matplotlib, Agg backend: no display needed).

    ttft_cdf.png             TTFT CDF, one line per rate (successful requests), the TTFT SLO drawn
    tpot_cdf.png             TPOT CDF, one line per rate, the TPOT SLO drawn
    itl_cdf.png              ITL CDF, one line per rate
    e2e_cdf.png              end-to-end latency CDF, one line per rate
    goodput_vs_rate.png      goodput and request throughput against offered rate   (sweeps only)
    achieved_vs_rate.png     achieved against offered request rate, and y = x      (sweeps only)
    p99_itl_vs_rate.png      p99 ITL against offered rate, the TPOT SLO drawn       (sweeps only)
    tpot_vs_rate.png         TPOT p50 and p99 against offered rate, the SLO drawn   (sweeps only)

`write_comparison` draws two results side by side (``kvrelay bench compare
--plots DIR``): each CDF at the highest rate both ran, one line per result,
and, when both swept two or more rates, goodput and TPOT p99 against rate.

Rate plots start their y-axis at 0 (a throughput axis that starts elsewhere
exaggerates a difference) and need two or more finite rates; an ``inf`` rate
has no place on the axis and is left out of them.
"""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from cluster.bench.report import rate_from_json  # noqa: E402
from cluster.bench.runner import rate_name  # noqa: E402

STYLES = ("-o", "--s", ":^", "-.v")  # distinct when lines overlap


def _title(data: dict, what: str) -> str:
    return f"{what} - {data['label']}" if data.get("label") else what


def _ok(reqs):
    return [r for r in reqs if r["is_ok"]]


# what each CDF plots, in ms, from a run's requests; and which SLO it draws
CDFS = {
    "TTFT": (lambda reqs: [r["ttft_s"] * 1000 for r in _ok(reqs) if r["ttft_s"] is not None], "slo_ttft_ms",
             "fraction of requests"),
    "TPOT": (lambda reqs: [r["tpot_s"] * 1000 for r in _ok(reqs) if r.get("tpot_s") is not None], "slo_tpot_ms",
             "fraction of requests"),
    "ITL": (lambda reqs: [g * 1000 for r in _ok(reqs) for g in r["itls_s"]], None, "fraction of token gaps"),
    "E2E": (lambda reqs: [r["e2e_s"] * 1000 for r in _ok(reqs) if r.get("e2e_s") is not None], None,
            "fraction of requests"),
}


def _slo(data: dict, key: str | None) -> float | None:
    return None if key is None else (data.get("config") or {}).get(key)


def _draw_slo(ax, value: float | None, vertical: bool) -> None:
    if value is None:
        return
    (ax.axvline if vertical else ax.axhline)(value, color="crimson", linestyle="--", linewidth=1,
                                             label=f"SLO {value:g} ms")


def _finish(fig, ax, legend_title: str | None = None):
    ax.grid(alpha=0.3)
    if ax.has_data():
        ax.legend(title=legend_title)
    fig.tight_layout()
    return fig


def _save(figures: dict, out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fig in figures.items():
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        written.append(out / name)
    return written


def _cdf(what: str, title: str, lines: list[tuple[str, list[float]]], slo: float | None,
         legend_title: str) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, values in lines:
        xs = sorted(values)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)
    _draw_slo(ax, slo, vertical=True)
    ax.set_xlabel(f"{what} (ms)")
    ax.set_ylabel(CDFS[what][2])
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    return _finish(fig, ax, legend_title)


def _against_rate(title: str, ylabel: str, series: dict[str, list[tuple[float, float]]],
                  slo: float | None = None, diagonal: bool = False) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for (name, points), style in zip(series.items(), STYLES * 4):
        ax.plot([x for x, _ in points], [y for _, y in points], style, label=name)
    if diagonal:
        top = max((x for points in series.values() for x, _ in points), default=1.0)
        ax.plot([0, top], [0, top], color="grey", linewidth=1, linestyle=":", label="achieved = offered")
    _draw_slo(ax, slo, vertical=False)
    ax.set_xlabel("offered request rate (req/s)")
    ax.set_ylabel(ylabel)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    return _finish(fig, ax)


def _finite_runs(data: dict) -> list[tuple[float, dict]]:
    return sorted((rate_from_json(r["request_rate"]), r["summary"]) for r in data["runs"]
                  if not math.isinf(rate_from_json(r["request_rate"])))


def _dist(runs, key: str, q: str) -> list[tuple[float, float]]:
    return [(r, s[key][q]) for r, s in runs if s.get(key, {}).get(q) is not None]


def figures(data: dict) -> dict:
    """File name -> matplotlib figure, for every plot of ``data``."""
    figs = {}
    for what, (values, slo_key, _) in CDFS.items():
        lines = [(f"{rate_name(rate_from_json(run['request_rate']))} req/s", values(run["requests"]))
                 for run in data["runs"]]
        figs[f"{what.lower()}_cdf.png"] = _cdf(what, _title(data, f"{what} CDF"), lines, _slo(data, slo_key),
                                               "offered rate")
    finite = _finite_runs(data)
    if len(finite) >= 2:
        slo_tpot = _slo(data, "slo_tpot_ms")
        figs["goodput_vs_rate.png"] = _against_rate(_title(data, "Goodput"), "req/s", {
            "goodput (within SLOs)": [(r, s["goodput"]) for r, s in finite],
            "throughput (all completed)": [(r, s["request_throughput"]) for r, s in finite]})
        figs["achieved_vs_rate.png"] = _against_rate(_title(data, "Achieved against offered rate"), "achieved req/s",
                                                     {"achieved (completed)": [(r, s["request_throughput"])
                                                                               for r, s in finite]}, diagonal=True)
        figs["p99_itl_vs_rate.png"] = _against_rate(_title(data, "p99 inter-token latency"), "ms",
                                                    {"p99 ITL": _dist(finite, "itl_ms", "p99")}, slo_tpot)
        figs["tpot_vs_rate.png"] = _against_rate(_title(data, "Time per output token"), "ms", {
            "TPOT p50": _dist(finite, "tpot_ms", "p50"), "TPOT p99": _dist(finite, "tpot_ms", "p99")}, slo_tpot)
    return figs


def write_plots(data: dict, out_dir: str | Path) -> list[Path]:
    """Write the plots of ``data`` into ``out_dir``; returns the files written."""
    return _save(figures(data), out_dir)


def comparison_figures(a: dict, b: dict) -> dict:
    """File name -> figure, for results ``a`` and ``b`` drawn together."""
    na, nb = a.get("label") or "A", b.get("label") or "B"
    if na == nb:
        na, nb = f"A: {na}", f"B: {nb}"
    rates_a = {rate_from_json(r["request_rate"]): r for r in a["runs"]}
    rates_b = {rate_from_json(r["request_rate"]): r for r in b["runs"]}
    common = sorted(set(rates_a) & set(rates_b))
    figs = {}
    if common:
        rate = common[-1]
        for what, (values, slo_key, _) in CDFS.items():
            lines = [(na, values(rates_a[rate]["requests"])), (nb, values(rates_b[rate]["requests"]))]
            figs[f"compare_{what.lower()}_cdf.png"] = _cdf(
                what, f"{what} CDF at {rate_name(rate)} req/s: {na} vs {nb}", lines,
                _slo(a, slo_key) or _slo(b, slo_key), "result")
    fa, fb = _finite_runs(a), _finite_runs(b)
    if len(fa) >= 2 and len(fb) >= 2:
        figs["compare_goodput_vs_rate.png"] = _against_rate(
            f"Goodput: {na} vs {nb}", "req/s", {na: [(r, s["goodput"]) for r, s in fa],
                                                nb: [(r, s["goodput"]) for r, s in fb]})
        figs["compare_tpot_p99_vs_rate.png"] = _against_rate(
            f"TPOT p99: {na} vs {nb}", "ms", {na: _dist(fa, "tpot_ms", "p99"), nb: _dist(fb, "tpot_ms", "p99")},
            _slo(a, "slo_tpot_ms") or _slo(b, "slo_tpot_ms"))
    return figs


def write_comparison(a: dict, b: dict, out_dir: str | Path) -> list[Path]:
    """Write `comparison_figures` into ``out_dir`` (`kvrelay bench compare --plots DIR`)."""
    return _save(comparison_figures(a, b), out_dir)
