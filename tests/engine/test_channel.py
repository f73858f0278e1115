"""The request channel between the frontend and a replica: commands reach the
replica, each event reaches the inbox of its request, a peer without the
secret gets nothing, and a broken connection ends the requests on it at both
ends."""
from __future__ import annotations

import asyncio
import queue
import socket

import pytest

from engine.sampling import SamplingParams
from engine.serving.channel import ChannelClient, ChannelError, ChannelServer
from engine.serving.frames import Abort, Deltas, FirstToken, Lost, Submit
from engine.serving.types import GenerateDelta, TokenLogprob

SECRET = b"s" * 32


class Replica:
    """A replica's end that records its commands and its lost channel."""

    def __init__(self, address: str, secret: bytes = SECRET, replica_id: str = "decode-0"):
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.lost = queue.SimpleQueue()
        self.client = ChannelClient(address, secret, replica_id, lambda ch, msg: self.commands.put(msg),
                                    lambda ch: self.lost.put(True))


async def _in_thread(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


async def _server(**kw) -> ChannelServer:
    server = ChannelServer(SECRET, **kw)
    await server.start()
    return server


async def _connected(**kw) -> tuple[ChannelServer, Replica]:
    """A server with decode-0 dialled in."""
    server = await _server(**kw)
    replica = await _in_thread(Replica, server.address)
    await server.wait_connected(["decode-0"], 5)
    return server, replica


def test_commands_reach_the_replica_and_events_reach_their_request():
    async def main():
        server, replica = await _connected()
        inbox = server.open("r1", ["decode-0"])
        other = server.open("r2", ["decode-0"])
        submit = Submit("r1", [1, 2, 3], SamplingParams(max_tokens=4))
        server.send("decode-0", submit)
        assert await _in_thread(replica.commands.get, True, 5) == submit
        first = FirstToken(GenerateDelta("r1", [7], " Paris", logprobs=[TokenLogprob(7, -0.25, ((7, -0.25),))]))
        replica.client.send(first)
        replica.client.send(Deltas([GenerateDelta("r2", [5], "a"), GenerateDelta("r1", [8], "b"),
                                    GenerateDelta("gone", [1], "")]))
        assert await asyncio.wait_for(inbox.get(), 5) == first
        assert await asyncio.wait_for(inbox.get(), 5) == GenerateDelta("r1", [8], "b")
        assert await asyncio.wait_for(other.get(), 5) == GenerateDelta("r2", [5], "a")
        with pytest.raises(ValueError, match="already running"):
            server.open("r1", ["decode-0"])
        with pytest.raises(ChannelError, match="prefill-0"):
            server.open("r3", ["prefill-0"])
        server.close("r1")
        server.close("r2")
        replica.client.close()
        await server.stop()
    asyncio.run(main())


def test_a_peer_without_the_secret_gets_no_channel_and_a_fake_frontend_is_refused():
    async def main():
        server = await _server()
        with pytest.raises((ChannelError, ConnectionError, OSError)):
            await _in_thread(Replica, server.address, b"wrong" * 8)
        await asyncio.sleep(0.1)
        assert not server.is_connected("decode-0")
        with pytest.raises(ChannelError, match="did not connect"):
            await server.wait_connected(["decode-0"], 0.2)
        await server.stop()

        impostor = await _server()  # a "frontend" that does not know the replica's secret
        impostor.secret = b"x" * 32
        with pytest.raises((ChannelError, ConnectionError, OSError)):
            await _in_thread(Replica, impostor.address)
        await impostor.stop()
    asyncio.run(main())


def test_a_dead_replica_ends_its_requests_and_a_gone_frontend_tells_the_replica():
    async def main():
        lost = []
        server, replica = await _connected(on_lost=lost.append)
        inbox = server.open("r1", ["decode-0"])
        replica.client._sock.shutdown(socket.SHUT_RDWR)  # the replica process goes: its socket closes
        assert await asyncio.wait_for(inbox.get(), 5) == Lost("decode-0")
        assert lost == ["decode-0"] and not server.is_connected("decode-0")
        with pytest.raises(ChannelError):
            server.send("decode-0", Abort("r1"))

        replica = await _in_thread(Replica, server.address)  # it comes back
        await server.wait_connected(["decode-0"], 5)
        server.drop("decode-0")  # Ray says it is dead
        assert await _in_thread(replica.lost.get, True, 5)
        assert replica.client.send(Deltas([])) is False
        await server.stop()
    asyncio.run(main())


def test_an_oversized_frame_drops_the_connection_without_reading_it():
    async def main():
        server, replica = await _connected()
        inbox = server.open("r1", ["decode-0"])
        replica.client._sock.sendall((1 << 31).to_bytes(4, "big"))
        assert await asyncio.wait_for(inbox.get(), 5) == Lost("decode-0")
        await server.stop()
    asyncio.run(main())


def test_a_replica_cannot_reach_a_frontend_that_is_not_there():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(OSError):
        Replica(f"127.0.0.1:{port}")


def test_the_server_listens_on_the_first_free_port_of_its_range():
    async def main():
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            first = taken.getsockname()[1]
            server = await _server(ports=(first, first + 20))
            port = int(server.address.rsplit(":", 1)[1])
            assert first < port <= first + 20
            with pytest.raises(ChannelError, match="network.channel_ports"):
                await _server(ports=(first, first))
            await server.stop()
    asyncio.run(main())
