"""`kvrelay bench` end to end: over the gRPC echo frontend, over a scaffold OpenAI-style SSE server,
and against servers that stall (the run must still end)."""
import asyncio
import json
import threading
import time

import pytest

from cluster.bench import plots
from aiohttp import web

from cluster.bench.runner import BenchConfig, run_bench
from cluster.bench.workload import WorkloadError
from cluster.cli import main


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


class SseServer:
    """A tiny OpenAI-style /v1 server (scaffold until the real HTTP frontend lands).

    Streams ``max_tokens`` words as server-sent events, ``tokens_per_event`` per event, then usage (when
    asked for and ``include_usage``) and ``[DONE]``. ``mode``: "ok", "stall" (one event, then nothing
    until closed) or "error" (HTTP 429 with an OpenAI error body).
    """

    def __init__(self):
        self.mode, self.tokens_per_event, self.include_usage = "ok", 1, True
        self.bodies: list[dict] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.release = asyncio.Event()
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        self.runner = web.AppRunner(app, shutdown_timeout=1.0)
        self.call(self.runner.setup())
        self.call(web.TCPSite(self.runner, "127.0.0.1", 0).start())
        self.base_url = "http://127.0.0.1:%d/v1" % self.runner.addresses[0][1]

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def completions(self, request):
        body = await request.json()
        self.bodies.append(body)
        if self.mode == "error":
            return web.json_response({"error": {"message": "server busy (test)", "type": "overloaded"}}, status=429)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n, sent = body["max_tokens"], 0
        while sent < n:
            k = min(self.tokens_per_event, n - sent)
            sent += k
            choice = {"index": 0, "text": "word " * k, "finish_reason": "length" if sent == n else None}
            await resp.write(b"data: " + json.dumps({"object": "text_completion", "choices": [choice]}).encode()
                             + b"\n\n")
            if self.mode == "stall":
                await asyncio.wait_for(self.release.wait(), 30)
            await asyncio.sleep(0.002)
        if self.include_usage and body.get("stream_options", {}).get("include_usage"):
            usage = {"prompt_tokens": len(body["prompt"].split()) + 1, "completion_tokens": n, "total_tokens": 0}
            await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def close(self):
        self.loop.call_soon_threadsafe(self.release.set)
        self.call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def sse():
    server = SseServer()
    yield server
    server.close()


def bench(config: BenchConfig):
    return asyncio.run(run_bench(config, progress_stream=None))


def assert_all_ok(records):
    for r in records:
        assert r.is_ok, (r.error_code, r.error_message)
        assert r.num_output_tokens == r.output_len
        assert 0 < r.ttft_s <= r.e2e_s


# ---- gRPC, over the echo frontend -------------------------------------------------------------------------
def test_grpc_sweep_writes_results_and_plots(served, tmp_path, capsys):
    served.backend.delay_s = 0.002
    out = tmp_path / "run"
    argv = ["bench", "--target", served.target, "--num-prompts", "10", "--rates", "40,80", "--input-len", "6",
            "--output-len", "8", "--range-ratio", "0.5", "--warmup", "2", "--seed", "7", "--slo-ttft-ms", "2000",
            "--slo-tpot-ms", "500", "--label", "echo", "--out", str(out), "--quiet"]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert "kvrelay bench [echo]" in stdout and "max rate at >= 90% SLO attainment: 80 req/s" in stdout

    data = json.loads((out / "results.json").read_text())
    assert data["schema_version"] == 1 and data["label"] == "echo" and data["server"]["model"] == "echo"
    assert data["config"]["rates"] == [40, 80] and "api_key" not in data["config"]
    assert data["max_rate_at_90pct_attainment"] == 80
    assert len(data["warmup_requests"]) == 2 and len(served.backend.requests) == 22
    for run in data["runs"]:
        s, reqs = run["summary"], run["requests"]
        assert s["num_completed"] == s["num_requests"] == len(reqs) == 10 and s["errors"] == {}
        assert s["slo_attainment"] == 1.0 and s["goodput"] == pytest.approx(s["request_throughput"])
        assert s["total_output_tokens"] == sum(r["output_len"] for r in reqs)
        assert s["ttft_ms"]["p50"] <= s["e2e_ms"]["p50"] and s["itl_ms"]["p99"] >= s["itl_ms"]["p50"] > 0
        assert s["tpot_ms"]["mean"] >= 2.0  # the echo backend sleeps 2 ms per token
        for r in reqs:
            assert r["is_ok"] and r["num_output_tokens"] == r["output_len"]
            assert len(r["itls_s"]) == r["num_output_tokens"] - 1
            assert 0 <= r["scheduled_s"] <= r["start_s"] and 0 < r["ttft_s"] <= r["e2e_s"]
    lens = [(r["prompt_len"], r["output_len"]) for r in data["runs"][0]["requests"]]
    assert lens == [(r["prompt_len"], r["output_len"]) for r in data["runs"][1]["requests"]]
    assert len(set(lens)) > 1  # --range-ratio spreads the lengths
    sent = [list(req.prompt_token_ids) for req in served.backend.requests]
    assert len({tuple(p) for p in sent}) > 12  # each rate gets fresh prompts
    for name in ("ttft_cdf.png", "tpot_cdf.png", "itl_cdf.png", "e2e_cdf.png", "goodput_vs_rate.png",
                 "achieved_vs_rate.png", "p99_itl_vs_rate.png", "tpot_vs_rate.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    figs = plots.figures(data)
    slo_lines = lambda fig: [ln.get_label() for ln in fig.axes[0].get_lines() if ln.get_label().startswith("SLO")]  # noqa: E731
    assert slo_lines(figs["ttft_cdf.png"]) == ["SLO 2000 ms"]  # the SLOs given on the command line are drawn
    assert slo_lines(figs["tpot_cdf.png"]) == slo_lines(figs["tpot_vs_rate.png"]) == ["SLO 500 ms"]
    for name in ("goodput_vs_rate.png", "achieved_vs_rate.png", "tpot_vs_rate.png", "p99_itl_vs_rate.png"):
        assert figs[name].axes[0].get_ylim()[0] == 0, name  # rate plots start at 0
    achieved = {ln.get_label(): ln for ln in figs["achieved_vs_rate.png"].axes[0].get_lines()}
    assert list(achieved["achieved = offered"].get_xdata()) == [0, 80]
    assert list(achieved["achieved (completed)"].get_xdata()) == [40, 80]

    # compare two runs as markdown
    other = dict(data, label="disagg", runs=data["runs"][:1])
    (tmp_path / "b.json").write_text(json.dumps(other))
    md = tmp_path / "cmp.md"
    assert main(["bench", "compare", str(out / "results.json"), str(tmp_path / "b.json"), "--out", str(md)]) == 0
    table = capsys.readouterr().out
    assert table.startswith("| rate req/s | metric | echo | disagg | B/A |")
    assert "| 40 | req/s |" in table and "| 80 | TTFT p99 ms |" in table and "| 80 | req/s | " in table
    assert "| 40 | failed | 0 | 0 | - |" in table and "| - | max rate at 90% SLO attainment | 80 | 80 | - |" in table
    assert md.read_text() == table
    drawn = tmp_path / "cmp"
    assert main(["bench", "compare", str(out / "results.json"), str(tmp_path / "b.json"), "--plots", str(drawn)]) == 0
    assert sorted(p.name for p in drawn.iterdir()) == sorted(  # b ran one rate: CDFs at 40 req/s, no sweep plots
        ["compare_ttft_cdf.png", "compare_tpot_cdf.png", "compare_itl_cdf.png", "compare_e2e_cdf.png"])
    cmp = plots.comparison_figures(data, dict(data, label="disagg"))
    assert [ln.get_label() for ln in cmp["compare_goodput_vs_rate.png"].axes[0].get_lines()] == ["echo", "disagg"]
    assert "at 80 req/s" in cmp["compare_ttft_cdf.png"].axes[0].get_title()


def test_grpc_max_concurrency_and_errors(served):
    served.backend.delay_s = 0.005
    result = bench(BenchConfig(target=served.target, num_prompts=6, input_len=4, output_len=4, max_concurrency=2))
    recs = result.runs[0].records
    assert_all_ok(recs)
    spans = sorted((r.start_s, r.end_s) for r in recs)
    assert all(sum(s <= t < e for s, e in spans) <= 2 for t, _ in spans)  # never more than 2 in flight

    served.backend.overloaded = True
    result = bench(BenchConfig(target=served.target, num_prompts=3, input_len=4, output_len=4, slo_ttft_ms=1e4))
    s = result.runs[0].summary
    assert s["errors"] == {"RESOURCE_EXHAUSTED": 3} and s["num_completed"] == 0
    assert s["slo_attainment"] == 0.0 and s["goodput"] == 0.0 and result.max_rate_at_90pct_attainment is None
    assert "all replicas are busy" in result.runs[0].records[0].error_message

    with pytest.raises(WorkloadError, match="do not fit the served context of 64"):
        bench(BenchConfig(target=served.target, num_prompts=3, input_len=40, output_len=40))


def test_grpc_stalled_requests_are_cancelled_at_the_cap(served):
    served.backend.delay_s = 30.0  # the first token never comes in time
    t0 = time.monotonic()
    result = bench(BenchConfig(target=served.target, num_prompts=4, input_len=4, output_len=4,
                               duration_s=0.3, grace_s=0.2))
    assert time.monotonic() - t0 < 5
    s = result.runs[0].summary
    assert s["errors"] == {"CANCELLED": 4} and s["num_completed"] == 0
    assert all(r.ttft_s is None and r.end_s >= 0.5 for r in result.runs[0].records)
    wait_for(lambda: not served.backend.running)  # the cancellation reached the server


# ---- OpenAI HTTP, over the scaffold SSE server ------------------------------------------------------------
def test_http_counts_tokens_from_usage_or_events(sse):
    sse.tokens_per_event = 2  # an event is not a token: usage gives the true count
    c = BenchConfig(backend="openai", base_url=sse.base_url, num_prompts=5, input_len=6, output_len=7,
                    rates=[200.0], slo_tpot_ms=1000, temperature=0.0)
    result = bench(c)
    assert result.server.model == "tiny"
    recs = result.runs[0].records
    assert_all_ok(recs)
    assert all(len(r.itls_s) == 3 and r.prompt_len == 7 for r in recs)  # 4 events; usage's prompt count
    body = sse.bodies[0]
    assert body["model"] == "tiny" and body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 7 and body["temperature"] == 0.0
    assert len(body["prompt"].split()) == 6
    assert result.runs[0].summary["total_output_tokens"] == 35

    sse.tokens_per_event, sse.include_usage = 1, False  # no usage: one event counts as one token
    recs = bench(c).runs[0].records
    assert_all_ok(recs)
    assert all(len(r.itls_s) == 6 and r.prompt_len == 6 for r in recs)


def test_http_errors_and_stalls_end_the_run(sse, tmp_path, capsys):
    sse.mode = "error"
    out = tmp_path / "err"
    assert main(["bench", "--backend", "openai", "--base-url", sse.base_url, "--model", "m", "--num-prompts", "2",
                 "--input-len", "3", "--output-len", "3", "--out", str(out), "--no-plots", "--quiet"]) == 0
    assert "2 x HTTP_429" in capsys.readouterr().out
    data = json.loads((out / "results.json").read_text())
    assert data["runs"][0]["requests"][0]["error_message"] == "server busy (test)"
    assert data["config"]["rates"] == ["inf"] and data["max_rate_at_90pct_attainment"] is None
    assert sorted(p.name for p in out.iterdir()) == ["results.json"]

    sse.mode = "stall"  # one event, then silence: cancelled at the cap
    t0 = time.monotonic()
    result = bench(BenchConfig(backend="openai", base_url=sse.base_url, num_prompts=30, input_len=3, output_len=3,
                               rates=[20.0], seed=3, duration_s=0.5, grace_s=0.3))
    assert time.monotonic() - t0 < 5
    recs, s = result.runs[0].records, result.runs[0].summary
    assert 0 < s["num_sent"] < 30 and s["num_not_sent"] == 30 - s["num_sent"]  # nothing issued after the cap
    assert s["errors"] == {"CANCELLED": s["num_sent"]} and s["num_completed"] == 0
    sent = [r for r in recs if r.start_s is not None]
    assert all(r.num_output_tokens == 1 and r.ttft_s is not None and r.end_s >= 0.8 for r in sent)
    assert all(r.scheduled_s < 0.5 for r in sent) and "duration cap" in sent[0].error_message
