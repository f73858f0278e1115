"""How rank 0 starts the other ranks of a tensor-parallel group: the launcher seam of
`engine.parallel.group.TPGroup`.

A launcher turns each rank's `WorkerSpec` into a running `engine.parallel.worker.worker_main`
and hands back, per rank, a `RankProcess` (its liveness, join and kill) and a connection that
carries the worker's messages to rank 0 (Attached, Ready, Failed). Two exist:

- `SpawnLauncher` (here): multiprocessing spawn children over pipes, what the offline
  `engine.LLM(tensor_parallel_size=N)` uses;
- `cluster.tp_ranks.RayRankLauncher`: Ray actors in the replica's placement group, which dial
  back to rank 0 over an authenticated loopback socket (`RankListener`).

Every rank runs on rank 0's host (the ranks share the step channel's segment), so rank 0 can
watch any rank's process by its pid (`PidWatch`).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import select
import signal
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener
from typing import Protocol

from engine.parallel.comm import CollectiveError
from engine.parallel.worker import WorkerSpec, worker_main


class RankProcess(Protocol):
    pid: int

    @property
    def exitcode(self) -> int | None:
        """None while the rank's process runs; its exit code after (-1 where it is not known)."""

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` for the process to end."""

    def is_alive(self) -> bool: ...

    def kill(self) -> None:
        """End the process now (SIGKILL or its equivalent)."""


class RankLauncher(Protocol):
    num_threads: int | None  # torch threads per rank; None: this host's cores shared among the ranks
    isolates_devices: bool  # each rank's cuda:0 is its own GPU (Ray), not rank r's cuda:r (engine.parallel.devices)

    def see_devices(self, device: str) -> None:
        """Called first in rank 0's process, before CUDA starts there: make the GPUs the group needs
        visible to it (the engine's ``device``: "cpu" or "cuda")."""

    def start(self, specs: list[WorkerSpec], timeout_s: float) -> list[tuple[RankProcess, Connection]]:
        """Start ranks 1..N-1 (``specs`` in rank order); return each one's process and connection,
        in the same order. Raises CollectiveError naming the rank that did not come."""


class SpawnLauncher:
    """Ranks as multiprocessing spawn children of rank 0 (daemonic: they go with it)."""

    num_threads = None
    isolates_devices = False  # children see every GPU: rank r takes cuda:r

    def see_devices(self, device: str) -> None:
        pass  # this process sees the host's GPUs already

    def start(self, specs: list[WorkerSpec], timeout_s: float) -> list[tuple[RankProcess, Connection]]:
        ctx = mp.get_context("spawn")
        out = []
        for spec in specs:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(spec, child), name=f"kvrelay-tp-rank{spec.rank}", daemon=True)
            p.start()
            child.close()
            out.append((p, parent))
        return out


class PidWatch:
    """A process that is not this one's child, watched through a pidfd (no race with pid reuse).
    ``exitcode`` is None while it runs, -1 once it is gone (its code belongs to its parent)."""

    def __init__(self, pid: int):
        self.pid = pid
        try:
            self._fd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            self._fd = None  # already gone

    @property
    def exitcode(self) -> int | None:
        return None if self.is_alive() else -1

    def is_alive(self) -> bool:
        if self._fd is None:
            return False
        return not select.select([self._fd], [], [], 0)[0]

    def join(self, timeout: float | None = None) -> None:
        if self._fd is not None:
            select.select([self._fd], [], [], timeout)

    def kill(self) -> None:
        if self._fd is not None and self.is_alive():
            signal.pidfd_send_signal(self._fd, signal.SIGKILL)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        self.close()


class RankListener:
    """Rank 0's end of the workers' connections when they are not its children: a loopback
    listener that authenticates each worker (multiprocessing's HMAC challenge, before anything
    is unpickled) and learns its rank and pid from its first message."""

    def __init__(self):
        self.authkey = secrets.token_bytes(32)
        self._listener = Listener(("127.0.0.1", 0), authkey=self.authkey)
        self.address = self._listener.address
        self._conns: dict[int, tuple[int, Connection]] = {}  # rank -> (pid, connection)
        self._error: BaseException | None = None
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._is_closed = False

    def accept(self, ranks: list[int], timeout_s: float, check=None) -> dict[int, tuple[int, Connection]]:
        """Each rank of ``ranks``'s (pid, connection); ``check()`` is called while waiting and may raise
        (a worker that failed to start)."""
        expected = set(ranks)
        self._thread = threading.Thread(target=self._accept, args=(len(expected),), daemon=True,
                                        name="kvrelay-tp-accept")
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not expected <= set(self._conns):
                if self._error is not None:
                    raise CollectiveError(f"tensor-parallel ranks could not connect: {self._error}")
                missing = sorted(expected - set(self._conns))
                if time.monotonic() > deadline:
                    raise CollectiveError(f"tensor-parallel rank(s) {missing} did not connect "
                                          f"to rank 0 within {timeout_s:g} s")
                self._lock.wait(0.1)
                if check is not None:
                    check()
            return {r: self._conns[r] for r in ranks}

    def _accept(self, n: int) -> None:
        try:
            while len(self._conns) < n:
                try:
                    conn = self._listener.accept()
                except (AuthenticationError, EOFError, ConnectionError):  # not one of ours, or gone mid-handshake
                    if self._is_closed:
                        return
                    continue
                try:
                    rank, pid = conn.recv() if conn.poll(30.0) else (None, None)
                except (EOFError, OSError, ValueError, TypeError):
                    rank = None
                if rank is None:  # silent, or gone before it said who it is
                    conn.close()
                    continue
                with self._lock:
                    self._conns[int(rank)] = (int(pid), conn)
                    self._lock.notify_all()
        except Exception as e:  # noqa: BLE001 - the listener closed
            with self._lock:
                self._error = e
                self._lock.notify_all()

    def close(self) -> None:
        self._is_closed = True
        try:
            self._listener.close()
        except OSError:
            pass


def dial_rank0(address, authkey: bytes, rank: int) -> Connection:
    """A worker's connection to rank 0's `RankListener` (it sends its rank and pid first)."""
    from multiprocessing.connection import Client

    conn = Client(tuple(address), authkey=authkey)
    conn.send((rank, os.getpid()))
    return conn
