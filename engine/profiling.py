"""Phase ranges for profilers, and a profiler window per stage loop.

`phase(name)` labels a stretch of the engine's hot path (schedule, forward,
sample, update, KV transfer start/commit, receiver poll). It is a shared
no-op context unless ranges are on in this process, so the loop pays one
global read per phase when nobody profiles. Ranges are on while a
`ProfileWindow` is open (`torch.profiler.record_function`, which shows in
the Chrome trace) and, on CUDA, always as NVTX ranges of the same names
(`enable_nvtx`), which Nsight Systems shows; a range push costs about a
microsecond, against a GPU step of milliseconds.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

PREFIX = "kvrelay."
SCHEDULE = PREFIX + "schedule"
FORWARD = PREFIX + "forward"
SAMPLE = PREFIX + "sample"
UPDATE = PREFIX + "update"
KV_TRANSFER_START = PREFIX + "kv_transfer_start"
KV_COMMIT = PREFIX + "kv_commit"
RECEIVER_POLL = PREFIX + "receiver_poll"

_num_windows = 0  # open ProfileWindows in this process: record_function ranges on
_nvtx = False  # NVTX ranges on (an engine on CUDA in this process)
_is_on = False  # either of the above
_OFF = contextlib.nullcontext()


def _refresh() -> None:
    global _is_on
    _is_on = _num_windows > 0 or _nvtx


def enable_nvtx(on: bool = True) -> None:
    """Emit NVTX ranges for the phases (a no-op without CUDA)."""
    global _nvtx
    _nvtx = bool(on) and torch.cuda.is_available()
    _refresh()


@contextlib.contextmanager
def _range(name: str):
    nvtx = _nvtx
    if nvtx:
        torch.cuda.nvtx.range_push(name)
    try:
        if _num_windows:
            with torch.profiler.record_function(name):
                yield
        else:
            yield
    finally:
        if nvtx:
            torch.cuda.nvtx.range_pop()


def phase(name: str):
    """``with phase(FORWARD): ...``: a labelled range while anyone profiles, else nothing."""
    return _range(name) if _is_on else _OFF


class ProfileWindow:
    """One `torch.profiler.profile` window, exported as a Chrome trace.

    Start and stop it on the thread that runs the engine (the stage loop):
    the phase ranges it records are that thread's.
    """

    def __init__(self, out_dir: str | Path, name: str, with_stack: bool = False, cuda: bool = False):
        self.path = Path(out_dir) / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns() % 10**6:06d}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda and torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities, with_stack=with_stack, record_shapes=False)

    def start(self) -> None:
        global _num_windows
        self._prof.start()
        _num_windows += 1
        _refresh()

    def stop(self) -> Path:
        """Stop, write the trace, return its path."""
        global _num_windows
        _num_windows -= 1
        _refresh()
        self._prof.stop()
        self._prof.export_chrome_trace(str(self.path))
        return self.path
