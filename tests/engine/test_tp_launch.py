"""The launcher seam's parts that the cluster's ranks use (engine.parallel.launch): rank 0's
listener authenticates each worker before unpickling anything and names a rank that never
comes; a pidfd watch sees a process that is not a child end."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

import pytest

from engine.parallel.comm import CollectiveError
from engine.parallel.launch import PidWatch, RankListener, dial_rank0


def test_a_worker_with_the_key_is_accepted_and_one_without_is_not():
    listener = RankListener()
    accepted = {}
    waiting = threading.Thread(target=lambda: accepted.update(listener.accept([1], timeout_s=20)))
    waiting.start()  # as rank 0 does while its ranks start
    try:
        with pytest.raises(AuthenticationError):
            Client(tuple(listener.address), authkey=b"not the key")
        worker = dial_rank0(listener.address, listener.authkey, 1)
        waiting.join(20)
        pid, conn = accepted[1]
        worker.send("hello")
        assert conn.recv() == "hello"
        assert pid > 0
    finally:
        listener.close()


def test_a_rank_that_never_connects_is_named_within_the_timeout():
    listener = RankListener()
    try:
        t0 = time.monotonic()
        with pytest.raises(CollectiveError, match=r"rank\(s\) \[1, 2\] did not connect to rank 0 within 0.5 s"):
            listener.accept([1, 2], timeout_s=0.5)
        assert time.monotonic() - t0 < 5
    finally:
        listener.close()


def test_pid_watch_sees_a_process_end():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watch = PidWatch(proc.pid)
    assert watch.is_alive() and watch.exitcode is None
    watch.kill()
    watch.join(10)
    assert not watch.is_alive() and watch.exitcode == -1
    proc.wait(10)
    watch.close()
