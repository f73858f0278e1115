import json
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_validate_good_spec(capsys):
    assert main(["validate", str(ROOT / "deploy" / "local.yaml")]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "prefill x1" in out


def test_validate_bad_spec_prints_paths(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("decode:\n  replicas: 0\nrouter:\n  policy: random\n  extra: 1\n")
    assert main(["validate", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "decode.replicas: must be >= 1, got 0" in err
    assert "router.policy: must be one of" in err and "router.extra: unknown field" in err


def test_validate_check_secrets(tmp_path, capsys, monkeypatch):
    spec = tmp_path / "s.yaml"
    spec.write_text("auth:\n  api_keys_env: KVR_CLI_TEST_KEYS\n")
    monkeypatch.delenv("KVR_CLI_TEST_KEYS", raising=False)
    assert main(["validate", str(spec)]) == 0
    assert main(["validate", "--check-secrets", str(spec)]) == 1
    assert "environment variable KVR_CLI_TEST_KEYS is not set" in capsys.readouterr().err


def test_python_dash_m_cluster_is_the_same_command(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("mode: both\n")
    run = subprocess.run([sys.executable, "-m", "cluster", "validate", str(bad)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "mode: must be one of" in run.stderr


def test_client_commands(served, capsys):
    assert main(["generate", "hello world", "--raw", "--target", served.target, "--max-tokens", "2",
                 "--show-tokens"]) == 0
    out = capsys.readouterr().out
    assert "<s> hello" in out and "finish: length" in out and "[1, 6]" in out

    assert main(["generate", "hello", "--raw", "--target", served.target, "--stream"]) == 0
    assert capsys.readouterr().out == "<s> hello \n"

    # without --raw the prompt is a user turn through the chat template
    assert main(["generate", "hello", "--target", served.target, "--max-tokens", "2"]) == 0
    assert "<|user|>" in capsys.readouterr().out

    assert main(["generate", "hello", "--target", served.target, "--max-tokens", "0"]) == 1
    assert "INVALID_ARGUMENT: max_tokens: must be >= 1" in capsys.readouterr().err

    assert main(["status", "--target", served.target]) == 0
    out = capsys.readouterr().out
    assert "model echo (colocated)" in out and "c1" in out and "NO" in out
    assert main(["status", "--json", "--target", served.target]) == 0
    assert '"replica_id": "c0"' in capsys.readouterr().out
    assert main(["models", "--target", served.target]) == 0
    assert capsys.readouterr().out.startswith("echo\t")


def test_status_does_not_show_a_dead_replicas_last_load(served, capsys):
    # EchoBackend's c1 is dead, its last report 7 running, 300 queued tokens, 5 in flight, 90% KV used
    assert main(["status", "--target", served.target]) == 0
    (c1,) = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("c1")]
    assert c1 == ["c1", "colocated", "1x1", "NO", "down", "-", "-", "-", "-", "0", "?/?"]  # ?/?: it never said
    assert main(["status", "--json", "--target", served.target]) == 0
    replicas = {r["replica_id"]: r for r in json.loads(capsys.readouterr().out)["replicas"]}
    assert replicas["c1"]["is_alive"] is False
    assert [replicas["c1"][k] for k in ("num_running_seqs", "num_queued_prefill_tokens", "num_in_flight",
                                        "num_free_blocks", "num_total_blocks")] == [None] * 5
    assert replicas["c0"]["num_total_blocks"] == 100  # a live one's load is shown


def test_chat_keeps_history(served, capsys, monkeypatch):
    lines = iter(["hello", "the cat", "/reset", "mat", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "--target", served.target, "--system", "a"]) == 0
    prompts = [r.prompt_token_ids for r in served.backend.requests]
    # <s> <|system|> a <|user|> hello <|assistant|>
    assert prompts[0] == [1, 3, 12, 4, 6, 5]
    # the second turn carries the first exchange (the echo's reply as the assistant's message)
    assert prompts[1][:6] == prompts[0] and prompts[1][-4:] == [4, 8, 9, 5]
    assert prompts[2] == [1, 3, 12, 4, 13, 5]  # after /reset only the system message remains


def test_serve_reports_a_bad_spec_without_starting(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("decode: {replicas: 0}\n")
    assert main(["serve", str(bad)]) == 1
    assert "decode.replicas" in capsys.readouterr().err


def test_no_command_is_a_usage_error():
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2


def test_profile_command(served, capsys, tmp_path):
    from cluster.cli import build_parser

    args = build_parser().parse_args(["profile", "--seconds", "1.5", "--out", "/tmp/t", "--target", "h:1"])
    assert (args.command, args.seconds, args.out, args.target) == ("profile", 1.5, "/tmp/t", "h:1")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["profile", "--seconds", "1"])  # --out is required

    assert main(["profile", "--seconds", "0.5", "--out", str(tmp_path), "--target", served.target]) == 0
    assert capsys.readouterr().out == f"c0\thost-a\t{tmp_path}/c0-1.json\n"
    assert served.backend.profiles == [(0.5, str(tmp_path))]
    assert main(["profile", "--seconds", "0", "--out", str(tmp_path), "--target", served.target]) == 1
    assert "INVALID_ARGUMENT: seconds: must be in" in capsys.readouterr().err


def test_status_names_each_replicas_weights_and_kernel_path(served, capsys, monkeypatch):
    """A deployment may mix weight formats (a gguf prefill pool, a bf16 decode pool): `kvrelay
    status` says which replica runs what, live or down; "?" where a server does not say."""
    from cluster.types import ClusterStatus, ReplicaStatus, Stage

    async def status():
        return ClusterStatus("echo", "disaggregated", (
            ReplicaStatus("p0", Stage.PREFILL, True, 0, 0, 0, 60, 64, quantization="gguf", kernel_isa="avx2"),
            ReplicaStatus("d0", Stage.DECODE, True, 1, 0, 1, 30, 64, quantization="none",
                          kernel_isa="avx512bf16"),
            ReplicaStatus("d1", Stage.DECODE, False, state="failed", quantization="int8", kernel_isa="avx2"),
            ReplicaStatus("d2", Stage.DECODE, True, 0, 0, 0, 64, 64),
        ), num_waiting=0)
    monkeypatch.setattr(served.backend, "status", status)
    assert main(["status", "--target", served.target]) == 0  # through the gRPC frontend and back
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[-1] == "weights/kernels"
    lines = {line.split()[0]: line.split() for line in out[2:]}
    assert lines["p0"][-1] == "gguf/avx2" and lines["d0"][-1] == "none/avx512bf16"
    assert lines["d1"][3:5] == ["NO", "failed"] and lines["d1"][-1] == "int8/avx2"
    assert lines["d2"][-1] == "?/?"
    assert main(["status", "--json", "--target", served.target]) == 0
    replicas = {r["replica_id"]: r for r in json.loads(capsys.readouterr().out)["replicas"]}
    assert (replicas["p0"]["quantization"], replicas["p0"]["kernel_isa"]) == ("gguf", "avx2")
    assert (replicas["d1"]["quantization"], replicas["d1"]["kernel_isa"]) == ("int8", "avx2")


def test_status_shows_a_parallel_replica_as_one_with_its_ranks(served, capsys, monkeypatch):
    from cluster.types import ClusterStatus, ReplicaStatus, Stage

    async def status():
        return ClusterStatus("echo", "colocated", (
            ReplicaStatus("c0", Stage.COLOCATED, True, 2, 0, 2, 30, 64, tensor_parallel_size=2,
                          rank_pids=(4100, 4101)),
            ReplicaStatus("c1", Stage.COLOCATED, True, 1, 0, 1, 60, 64),
            ReplicaStatus("c2", Stage.COLOCATED, True, 1, 0, 1, 60, 64, tensor_parallel_size=2,
                          pipeline_parallel_size=2, rank_pids=(4200, 4201, 4202, 4203)),
        ), num_waiting=0)
    monkeypatch.setattr(served.backend, "status", status)
    assert main(["status", "--target", served.target]) == 0  # through the gRPC frontend and back
    lines = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[2:]}
    assert lines["c0"][:4] == ["c0", "colocated", "2x1", "yes"] and lines["c0"][-3:] == ["(pid):", "4100", "4101"]
    assert lines["c1"][:4] == ["c1", "colocated", "1x1", "yes"] and "(pid):" not in lines["c1"]
    assert lines["c2"][:4] == ["c2", "colocated", "2x2", "yes"] and lines["c2"][-4:] == ["4200", "4201", "4202", "4203"]
    assert main(["status", "--json", "--target", served.target]) == 0
    replicas = {r["replica_id"]: r for r in json.loads(capsys.readouterr().out)["replicas"]}
    assert replicas["c0"]["tensor_parallel_size"] == 2 and replicas["c0"]["rank_pids"] == [4100, 4101]
    assert replicas["c1"]["tensor_parallel_size"] == 1
    assert (replicas["c2"]["tensor_parallel_size"], replicas["c2"]["pipeline_parallel_size"]) == (2, 2)
