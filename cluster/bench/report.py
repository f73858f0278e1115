"""results.json, the stdout tables, and the markdown comparison of two runs.

results.json (schema_version 1); rates are numbers, or the string "inf":

    {"schema_version": 1, "label": str | null, "created_at": ISO-8601 UTC,
     "config": {every BenchConfig field},
     "server": {"model", "vocab_size", "max_model_len"},
     "max_rate_at_90pct_attainment": rate | null,
     "runs": [{"request_rate": rate, "summary": {...see stats.summarize...},
               "requests": [record, ...]}],
     "warmup_requests": [record, ...]}

A record is a `stats.RequestRecord` (times in seconds from its run's start)
plus its derived ``e2e_s`` and ``tpot_s``.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from cluster.bench.runner import BenchResult, rate_name
from cluster.bench.stats import RequestRecord

SCHEMA_VERSION = 1
LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))


def rate_to_json(rate: float | None) -> float | str | None:
    return "inf" if rate is not None and math.isinf(rate) else rate


def rate_from_json(rate: float | str | None) -> float | None:
    return math.inf if rate == "inf" else rate


def record_to_json(rec: RequestRecord) -> dict:
    return {**asdict(rec), "e2e_s": rec.e2e_s, "tpot_s": rec.tpot_s}


def result_to_json(result: BenchResult) -> dict:
    config = asdict(result.config)
    config["rates"] = [rate_to_json(r) for r in config["rates"]]
    config.pop("api_key", None)  # never write a secret into results
    return {
        "schema_version": SCHEMA_VERSION,
        "label": result.config.label,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": config,
        "server": asdict(result.server),
        "max_rate_at_90pct_attainment": rate_to_json(result.max_rate_at_90pct_attainment),
        "runs": [{"request_rate": rate_to_json(r.request_rate), "summary": r.summary,
                  "requests": [record_to_json(x) for x in r.records]} for r in result.runs],
        "warmup_requests": [record_to_json(x) for x in result.warmup_records],
    }


def write_results(data: dict, out_dir: str | Path) -> Path:
    """Write a `result_to_json` dict to ``out_dir/results.json``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def load_results(path: str | Path) -> dict:
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"{path}: not a kvrelay bench results.json (schema_version {SCHEMA_VERSION})")
    return data


def _num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def format_tables(data: dict) -> str:
    """The readable report of a results.json dict: throughput per rate, then latencies per rate."""
    cfg, runs = data["config"], data["runs"]
    slo = f"TTFT <= {_num(cfg['slo_ttft_ms'], 0)} ms, TPOT <= {_num(cfg['slo_tpot_ms'], 0)} ms"
    lines = [f"kvrelay bench{' [' + data['label'] + ']' if data.get('label') else ''}: model "
             f"{data['server']['model']}, backend {cfg['backend']}, {cfg['num_prompts']} requests per rate; "
             f"SLO {slo}", ""]
    head = (f"{'rate/s':>7} {'ok/sent':>9} {'failed':>6} {'req/s':>7} {'out tok/s':>10} {'tot tok/s':>10} "
            f"{'goodput':>8} {'SLO att.':>8} {'dur s':>7}")
    lines += [head, "-" * len(head)]
    for r in runs:
        s = r["summary"]
        lines.append(f"{rate_name(rate_from_json(r['request_rate'])):>7} {s['num_completed']:>4}/{s['num_sent']:<4} "
                     f"{s['num_failed']:>6} {s['request_throughput']:>7.2f} {s['output_token_throughput']:>10.1f} "
                     f"{s['total_token_throughput']:>10.1f} {s['goodput']:>8.2f} {_pct(s['slo_attainment']):>8} "
                     f"{s['duration_s']:>7.2f}")
    lines += ["", f"{'rate/s':>7} {'metric':<6} {'mean ms':>9} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9}"]
    lines.append("-" * len(lines[-1]))
    for r in runs:
        for key, name in LATENCIES:
            d = r["summary"][key]
            lines.append(f"{rate_name(rate_from_json(r['request_rate'])):>7} {name:<6} {_num(d['mean']):>9} "
                         f"{_num(d['p50']):>9} {_num(d['p90']):>9} {_num(d['p99']):>9}")
    for r in runs:
        for code, n in r["summary"]["errors"].items():
            lines.append(f"rate {rate_name(rate_from_json(r['request_rate']))}/s: {n} x {code}")
    best = rate_from_json(data["max_rate_at_90pct_attainment"])
    lines += ["", f"max rate at >= 90% SLO attainment: {'None' if best is None else rate_name(best) + ' req/s'}"]
    return "\n".join(lines)


# (summary key, sub-key or None, name, digits)
_COMPARED = (
    ("request_throughput", None, "req/s", 2),
    ("output_token_throughput", None, "out tok/s", 1),
    ("goodput", None, "goodput req/s", 2),
    ("slo_attainment", None, "SLO attainment", 3),
    ("ttft_ms", "p50", "TTFT p50 ms", 1),
    ("ttft_ms", "p99", "TTFT p99 ms", 1),
    ("tpot_ms", "p50", "TPOT p50 ms", 2),
    ("tpot_ms", "p99", "TPOT p99 ms", 2),
    ("itl_ms", "p50", "ITL p50 ms", 2),
    ("itl_ms", "p99", "ITL p99 ms", 2),
    ("e2e_ms", "p50", "E2E p50 ms", 1),
    ("e2e_ms", "p99", "E2E p99 ms", 1),
    ("num_failed", None, "failed", 0),
)
_WORKLOAD_KEYS = ("num_prompts", "input_len", "output_len", "range_ratio", "dataset", "ignore_eos", "seed",
                  "burstiness", "max_concurrency", "slo_ttft_ms", "slo_tpot_ms")


def _metric(summary: dict, key: str, sub: str | None) -> float | None:
    v = summary.get(key)
    return v.get(sub) if isinstance(v, dict) and sub else v


def compare_results(a: dict, b: dict) -> str:
    """A markdown table putting two results.json dicts side by side, rate by rate (B/A is the ratio)."""
    name_a, name_b = a.get("label") or "A", b.get("label") or "B"
    if name_a == name_b:
        name_a, name_b = f"{name_a} (A)", f"{name_b} (B)"
    lines = [f"| rate req/s | metric | {name_a} | {name_b} | B/A |", "|---:|---|---:|---:|---:|"]
    runs_a = {rate_from_json(r["request_rate"]): r["summary"] for r in a["runs"]}
    runs_b = {rate_from_json(r["request_rate"]): r["summary"] for r in b["runs"]}
    for rate in sorted(set(runs_a) | set(runs_b)):
        sa, sb = runs_a.get(rate), runs_b.get(rate)
        for key, sub, name, digits in _COMPARED:
            va = _metric(sa, key, sub) if sa else None
            vb = _metric(sb, key, sub) if sb else None
            ratio = _num(vb / va, 2) if va and vb is not None else "-"
            lines.append(f"| {rate_name(rate)} | {name} | {_num(va, digits)} | {_num(vb, digits)} | {ratio} |")
    best_a, best_b = (rate_from_json(x["max_rate_at_90pct_attainment"]) for x in (a, b))
    fmt = lambda r: "None" if r is None else rate_name(r)  # noqa: E731
    lines.append(f"| - | max rate at 90% SLO attainment | {fmt(best_a)} | {fmt(best_b)} | - |")
    differ = [k for k in _WORKLOAD_KEYS if a["config"].get(k) != b["config"].get(k)]
    if differ:
        lines += ["", "Note: the workloads differ in " + ", ".join(
            f"{k} ({a['config'].get(k)} vs {b['config'].get(k)})" for k in differ) + "."]
    return "\n".join(lines)
