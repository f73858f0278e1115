"""Timeouts and task stops that never lose a cancellation.

Before 3.12, ``asyncio.wait_for`` drops a ``cancel()`` that lands in the
same loop iteration as the awaited thing finishing (CPython gh-86296): the
caller goes on as if it had never been cancelled. A loop that is stopped by
cancelling it (a health follower, a replica watcher, a request's event
pump) then runs on, and whoever awaits it hangs. That was seen: a frontend's
stop waited forever on its gRPC health follower on a loaded 2-core machine.

`within` is the timeout to use instead (``asyncio.timeout`` where there is
one: it tells its own expiry from an outside cancel), and `cancel_and_wait`
stops tasks even if one swallows a cancel anyway, bounded in time.
"""
from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Iterable
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


async def within(aw: Awaitable[T], timeout_s: float | None) -> T:
    """``await aw``, raising `TimeoutError` after ``timeout_s`` seconds (None: no limit).

    An outside cancel always propagates as `asyncio.CancelledError`.
    """
    if sys.version_info < (3, 11):  # no asyncio.timeout; 3.10's wait_for is the best there is
        return await asyncio.wait_for(aw, timeout_s)
    async with asyncio.timeout(timeout_s):
        return await aw


async def cancel_and_wait(tasks: Iterable[asyncio.Task], timeout_s: float, what: str) -> bool:
    """Cancel ``tasks`` and wait up to ``timeout_s`` seconds for them to end, cancelling again any that
    swallowed the cancel. False (after a warning naming ``what``) if some are still running then."""
    pending = {t for t in tasks if not t.done()}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while pending:
        for t in pending:
            t.cancel()
        left = deadline - loop.time()
        if left <= 0:
            log.warning("%s: %d task(s) did not stop within %.1fs of being cancelled: %s", what, len(pending),
                        timeout_s, ", ".join(t.get_name() for t in pending))
            return False
        _, pending = await asyncio.wait(pending, timeout=min(left, 0.5))
    return True
