"""A cancel is never lost to a timeout, and stopping tasks is bounded even when one swallows a cancel."""
import asyncio

import pytest

from engine.serving.timeouts import cancel_and_wait, within


async def _cancel_as_it_completes(timed) -> str:
    """Cancel a task in the very loop iteration in which the thing it awaits under a timeout completes."""
    fut = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(timed(fut, 10))
    await asyncio.sleep(0)  # the task now waits on fut
    fut.set_result("result")
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return "cancelled"


def test_a_cancel_that_lands_as_the_awaited_thing_completes_is_kept():
    assert asyncio.run(_cancel_as_it_completes(within)) == "cancelled"


def test_within_times_out_and_passes_results_and_errors():
    async def main():
        assert await within(asyncio.sleep(0, "x"), 1) == "x"
        assert await within(asyncio.sleep(0, "y"), None) == "y"
        with pytest.raises(TimeoutError):
            await within(asyncio.Event().wait(), 0.05)
        with pytest.raises(KeyError):
            await within(_raise(KeyError("k")), 1)

    asyncio.run(main())


async def _raise(e):
    raise e


def test_cancel_and_wait_stops_a_task_that_swallows_one_cancel():
    async def stubborn():
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            pass  # what a lost cancel looks like from outside: the task goes on
        await asyncio.Event().wait()

    async def main():
        task = asyncio.create_task(stubborn())
        await asyncio.sleep(0)
        assert await cancel_and_wait([task], 5.0, "test") is True
        assert task.cancelled()

    asyncio.run(main())


def test_cancel_and_wait_is_bounded_when_a_task_never_stops(caplog):
    async def immortal():
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass

    async def main():
        task = asyncio.create_task(immortal(), name="immortal")
        await asyncio.sleep(0)
        t0 = loop.time()
        assert await cancel_and_wait([task], 0.3, "the test's tasks") is False
        assert loop.time() - t0 < 2.0
        assert not task.done()

    loop = asyncio.new_event_loop()  # not asyncio.run: it would wait on the immortal task at the end
    try:
        with caplog.at_level("WARNING"):
            loop.run_until_complete(main())
    finally:
        loop.close()
    assert "the test's tasks: 1 task(s) did not stop within 0.3s" in caplog.text and "immortal" in caplog.text
