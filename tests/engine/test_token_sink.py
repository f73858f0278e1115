"""The first-token sink: a replica's token reaches the waiting request; a
peer without the secret, an id nobody waits on and an unreachable sink are
all harmless."""
from __future__ import annotations

import asyncio

from engine.token_sink import FirstToken, TokenSinkClient, TokenSinkServer

SECRET = b"s" * 32


async def _started() -> TokenSinkServer:
    server = TokenSinkServer(SECRET)
    await server.start()
    return server


def _send(client: TokenSinkClient, address: str, first: FirstToken) -> bool:
    return client.send(address, first)  # blocking, as from a replica's loop thread


def test_a_first_token_reaches_its_waiting_request():
    async def main():
        server = await _started()
        fut = server.wait("r1")
        client = TokenSinkClient()
        client.register(server.address, SECRET)
        lp = {"token_logprob": -0.25, "top": [[7, -0.25], [3, -2.0]]}
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, _send, client, server.address, FirstToken("other", 1, "x"))
        assert await loop.run_in_executor(None, _send, client, server.address, FirstToken("r1", 7, " Paris", lp))
        got = await asyncio.wait_for(fut, 5)
        assert got == FirstToken("r1", 7, " Paris", lp)
        server.discard("r1")
        client.close()
        await server.stop()
    asyncio.run(main())


def test_a_peer_without_the_secret_is_refused():
    async def main():
        server = await _started()
        fut = server.wait("r1")
        client = TokenSinkClient()
        client.register(server.address, b"wrong" * 8)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, _send, client, server.address, FirstToken("r1", 7))
        await asyncio.sleep(0.2)
        assert not fut.done()
        client.close()
        await server.stop()
    asyncio.run(main())


def test_an_unreachable_or_unregistered_sink_is_skipped_without_raising():
    client = TokenSinkClient()
    assert client.send("127.0.0.1:9", FirstToken("r", 1)) is False  # not registered
    client.register("127.0.0.1:1", SECRET)  # nothing listens there
    assert client.send("127.0.0.1:1", FirstToken("r", 1)) is False
    assert client.send("127.0.0.1:1", FirstToken("r", 1)) is False  # left alone for a while: no second connect
    client.close()
