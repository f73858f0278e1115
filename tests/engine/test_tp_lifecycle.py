"""A tensor-parallel LLM leaves no worker process and no shared-memory segment behind:
after close, garbage collection, an exception, a dead or stuck rank, Ctrl-C, or rank 0 killed."""
from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine.config import ConfigError
from engine.llm import LLM
from engine.parallel.comm import CollectiveError
from engine.parallel.shm import SEGMENT_PREFIX, SHM_DIR
from engine.sampling import SamplingParams
from tests.engine.factories import random_prompts, save_tiny_model

LONG = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
REPO = Path(__file__).resolve().parents[2]


def segments() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(SEGMENT_PREFIX)}


def is_running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def spawned_children() -> list[int]:
    """This process's multiprocessing-spawned children, other than the resource tracker."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ")
        except OSError:
            continue
        if int(stat[1]) == os.getpid() and stat[0] != "Z" and b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            out.append(int(pid))
    return out


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(is_running(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    save_tiny_model(folder, "llama")
    return folder


@pytest.fixture(autouse=True)
def no_leaks():
    before = segments()
    yield
    gc.collect()
    assert wait_gone(spawned_children()), "a tensor-parallel worker outlived its test"
    assert segments() <= before, "a shared-memory segment outlived its test"


def tp_llm(model, **kw) -> LLM:
    return LLM(str(model), dtype="float32", num_kv_blocks=64, tensor_parallel_size=2, **kw)


def test_close_stops_the_workers_and_the_segment_is_gone_once_started(model):
    before = segments()
    llm = tp_llm(model)
    pids = llm.core.tp_group.pids
    assert len(pids) == 1 and spawned_children() == pids
    assert segments() == before  # unlinked as soon as every rank mapped it
    llm.generate(random_prompts(2, 96, [4]), SamplingParams(max_tokens=4, temperature=0.0))
    assert llm.core.pool.is_fully_free()
    llm.close()
    assert not any(is_running(p) for p in pids)
    llm.close()  # idempotent
    with pytest.raises(CollectiveError, match="down"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2))


def test_garbage_collection_stops_the_workers(model):
    llm = tp_llm(model)
    pids = llm.core.tp_group.pids
    del llm
    gc.collect()
    assert wait_gone(pids, 10.0)


def test_an_exception_in_a_with_block_stops_the_workers(model):
    with pytest.raises(RuntimeError, match="user code"):
        with tp_llm(model) as llm:
            pids = llm.core.tp_group.pids
            raise RuntimeError("user code")
    assert not any(is_running(p) for p in pids)


def test_a_failed_start_stops_the_workers(model):
    with pytest.raises(ConfigError, match="max_model_len"):
        tp_llm(model, max_model_len=10_000)  # refused by rank 0 after the workers started


def test_a_bad_tensor_parallel_size_is_refused_before_any_worker_starts(model):
    with pytest.raises(ConfigError, match="tensor_parallel_size: 3 does not divide .*num_attention_heads"):
        LLM(str(model), dtype="float32", tensor_parallel_size=3)
    assert spawned_children() == []


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_dead_or_stuck_rank_fails_the_step_in_bounded_time(model, how):
    """SIGKILL: rank 0 sees the process gone; SIGSTOP: the collective times out."""
    llm = tp_llm(model, tp_timeout_s=2.0)
    (pid,) = llm.core.tp_group.pids
    rid = llm.add_request(random_prompts(1, 96, [8])[0], LONG)
    llm.step()
    os.kill(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(CollectiveError, match="gone|timeout"):
        while llm.has_unfinished():
            llm.step()
    assert time.monotonic() - t0 < 8.0
    assert wait_gone([pid], 10.0)  # a stopped worker is killed by the teardown
    llm.abort(rid)
    assert llm.core.pool.is_fully_free()
    llm.close()


SCRIPT = textwrap.dedent("""
    import faulthandler, signal, sys
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's ask for the stacks of an exit that hangs
    from engine.llm import LLM
    from engine.sampling import SamplingParams
    if __name__ == "__main__":
        llm = LLM(sys.argv[1], dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
        print("pids", *llm.core.tp_group.pids, flush=True)
        while True:
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
""")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_ctrl_c_or_killing_rank_0_leaves_no_worker(model, tmp_path, sig):
    """Ctrl-C: rank 0 unwinds and tears the group down. SIGKILL: nothing runs in rank 0,
    and the worker notices its parent is gone."""
    script = tmp_path / "serve_tp.py"
    script.write_text(SCRIPT)
    before = segments()
    err = tmp_path / "stderr.txt"  # a file, not a pipe nobody reads while the script runs
    with open(err, "w") as err_file:
        proc = subprocess.Popen([sys.executable, str(script), str(model)], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=err_file, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("pids"), err.read_text()
        pids = [int(p) for p in line.split()[1:]]
        time.sleep(0.5)  # generating
        proc.send_signal(sig)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:  # say where rank 0 is stuck
            proc.send_signal(signal.SIGUSR1)
            time.sleep(2.0)
            pytest.fail(f"rank 0 still runs 30 s after {sig.name}; its stderr, with every thread's stack:\n"
                        f"{err.read_text()[-12000:]}")
        assert wait_gone(pids, 10.0)
        assert segments() <= before
    finally:
        proc.kill()
        proc.wait()
