"""transports.heap: the glibc thresholds are applied once and report whether they took."""
from __future__ import annotations

import platform

from kvtransfer.transports import heap


def test_keep_large_buffers_is_idempotent_and_applies_on_glibc():
    first = heap.keep_large_buffers()
    assert heap.keep_large_buffers() is first
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert first is True
