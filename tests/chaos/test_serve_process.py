"""The `kvrelay serve` process itself killed (SIGKILL), as a user's
supervisor or the OOM killer would: it leaves no replica process, no Ray
process and no shared-memory segment behind; and in a Ray cluster it joined
(as under `ray job submit`), its replicas go with it, and a new `kvrelay
serve` starts the spec's replicas once: none is duplicated. A signal while it
starts stops the start at once, with nothing left behind."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from cluster.client import KVRelayClient

SPEC = """\
mode: disaggregated
dtype: float32
frontend: {grpc_port: 0, http_port: 0}
prefill: {replicas: 1, resources: {num_cpus: 0.25}, num_kv_blocks: 64}
decode: {replicas: 1, resources: {num_cpus: 0.25}, num_kv_blocks: 64}
"""


class Served:
    """`kvrelay serve SPEC` in a process of its own; ``target`` once it serves."""

    def __init__(self, spec: Path, env: dict, log: Path):
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-m", "cluster", "serve", str(spec)], env=env,
                                     stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 300
        while True:
            m = re.search(r"gRPC\s+127\.0\.0\.1:(\d+)", log.read_text())
            if m:
                self.target = f"127.0.0.1:{m.group(1)}"
                return
            assert self.proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)

    def answers(self) -> bool:
        with KVRelayClient(self.target, timeout=60) as c:
            return len(c.generate("Hello", max_tokens=4, temperature=0, ignore_eos=True).token_ids) == 4


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    return dict(env, OMP_NUM_THREADS="1", **extra)


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    while _alive(procs) and time.monotonic() < deadline:
        time.sleep(0.5)
    return _alive(procs)


def test_sigkill_of_serve_leaves_nothing_behind(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    shm_before = set(os.listdir("/dev/shm"))
    served = Served(spec, _env(), tmp_path / "serve.log")
    try:
        assert served.answers()
        log = served.log.read_text()  # long startup work shows its progress
        for line in ("model ready in", "starting a local Ray instance", "loading 2 replicas",
                     "prefill-0 loaded", "decode-0 loaded"):
            assert f"kvrelay: {line}" in log or f"kvrelay:   {line}" in log, line
        everything = psutil.Process(served.proc.pid).children(recursive=True)
        replicas = [p for p in everything if "Stage" in " ".join(p.cmdline()) or "Stage" in p.name()]
        assert len(replicas) == 2, [(p.pid, p.name()) for p in everything]
        ours = {n for n in set(os.listdir("/dev/shm")) - shm_before if not n.startswith("kvrelay-tp-")}
        os.kill(served.proc.pid, signal.SIGKILL)
        served.proc.wait(10)
        # the replicas (the memory and the cores) go at once; Ray's own agents notice within their poll
        assert not _wait_gone(replicas, 30), "replica processes outlived kvrelay serve"
        left = _wait_gone(everything, 150)
        assert not left, [(p.pid, p.name()) for p in left]
        assert not (ours & set(os.listdir("/dev/shm"))), "shared memory left behind"
    finally:
        if served.proc.poll() is None:
            served.proc.kill()


@pytest.fixture
def ray_head(ray_instance):
    """The session's Ray instance's address, for a `kvrelay serve` that joins it (as under `ray job submit`)."""
    return ray_instance.get_runtime_context().gcs_address


def _deployment_actors() -> dict[str, set[str]]:
    """Live kvrelay replica actors in the joined cluster, by deployment name."""
    import ray

    out: dict[str, set[str]] = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        name = a["name"]
        m = re.match(r"(kvrelay-[0-9a-f]{6})-((?:prefill|decode|colocated)-\d+(?:-r\d+)?)$", name)
        if m:
            out.setdefault(m.group(1), set()).add(m.group(2))
    return out


def test_a_new_serve_in_a_joined_cluster_replaces_the_killed_ones_replicas_once(tmp_path, ray_head):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    before = set(_deployment_actors())
    first = Served(spec, _env(RAY_ADDRESS=ray_head), tmp_path / "first.log")
    try:
        assert first.answers()
        (name,) = set(_deployment_actors()) - before
        assert _deployment_actors()[name] == {"prefill-0", "decode-0"}
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(10)
        deadline = time.monotonic() + 60  # the joined cluster reaps the dead driver's actors
        while name in _deployment_actors():
            assert time.monotonic() < deadline, f"{name}'s replicas outlived its kvrelay serve"
            time.sleep(0.5)
    finally:
        if first.proc.poll() is None:
            first.proc.kill()
    second = Served(spec, _env(RAY_ADDRESS=ray_head), tmp_path / "second.log")
    try:
        assert second.answers()
        now = _deployment_actors()
        assert set(now) - before == {n for n in now if n not in before and n != name}
        (new,) = set(now) - before
        assert now[new] == {"prefill-0", "decode-0"}  # the spec's replicas, once
        second.proc.send_signal(signal.SIGTERM)  # and a clean stop takes them away too
        assert second.proc.wait(60) == 0
        deadline = time.monotonic() + 30
        while new in _deployment_actors():
            assert time.monotonic() < deadline, "a stopped kvrelay serve left replicas behind"
            time.sleep(0.5)
    finally:
        if second.proc.poll() is None:
            second.proc.kill()


def test_a_signal_while_the_replicas_load_stops_the_start_at_once(tmp_path):
    """SIGINT (Ctrl-C) as soon as the replicas start loading: serve stops there, without first
    finishing the load and serving, and leaves no replica or Ray process behind."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "cluster", "serve", str(spec)], env=_env(),
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "kvrelay: loading 2 replicas" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        everything = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130, log.read_text()[-3000:]
        out = log.read_text()
        assert "kvrelay: stopping while starting" in out and "kvrelay: serving" not in out, out[-3000:]
        left = _wait_gone(everything, 150)
        assert not left, [(p.pid, p.name()) for p in left]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_ctrl_c_after_serving_shuts_down_quietly(tmp_path):
    """Ctrl-C once requests were served (the README's way to stop): serve exits 0, leaves no replica
    or Ray process behind, and no replica logs a broken transfer channel on the way out (the
    prefill replicas hang up their KV senders before the decode replicas close their servers)."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    served = Served(spec, _env(), tmp_path / "serve.log")
    try:
        for _ in range(3):  # KV moved over the transfer channel, as in the user's session
            assert served.answers()
        everything = psutil.Process(served.proc.pid).children(recursive=True)
        served.proc.send_signal(signal.SIGINT)
        assert served.proc.wait(60) == 0, served.log.read_text()[-3000:]
        out = served.log.read_text()
        assert "kvrelay: shutting down" in out, out[-3000:]
        tail = out[out.index("kvrelay: shutting down"):]
        assert "GOAWAY" not in tail and "Traceback" not in tail, tail[-3000:]
        assert not _wait_gone(everything, 150)
    finally:
        if served.proc.poll() is None:
            served.proc.kill()
