"""The request channel: one TCP connection between the frontend process and
each stage replica, carrying a request's commands in and its tokens out.

Ray starts the replicas, polls their load and notices when one dies; a
request itself never rides a Ray call. A Ray actor call costs about a
millisecond each way (task submission, the owner's bookkeeping, a thread
hop on each side), once to start a request and again for every batch of
tokens a Ray streaming generator yields; this channel costs a socket write
and a read, from the replica's loop thread straight to the frontend's event
loop.

Who connects: the frontend listens; at start each replica is told the
address and dials it (`ChannelClient`), so the frontend needs no way to
reach a replica other than Ray.

Handshake, mutual, the secret never crossing the wire: the server sends a
16-byte nonce; the client answers HMAC-SHA256(secret, "kvrelay-replica" ||
nonce), its own nonce and its replica id; the server answers
HMAC-SHA256(secret, "kvrelay-frontend" || client nonce). Only then is
anything decoded: frames are a 4-byte big-endian length and a pickled
frame dataclass of `engine.serving.frames` (the two ends are processes of
one deployment that both hold the secret, as Ray's own workers are).

A connection that breaks ends every request on it: the replica aborts what
they hold, the frontend ends them with an error and stops placing on the
replica. Nothing waits for a peer that is gone.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import pickle
import socket
import struct
import threading
from collections.abc import Callable, Iterable

from engine.serving.frames import Deltas, Lost
from engine.serving.timeouts import within

log = logging.getLogger(__name__)

_LEN = struct.Struct(">I")
_NONCE = 16
_PROOF = 32
MAX_FRAME = 256 << 20  # a frame past this is a broken or hostile peer: the connection is dropped
HANDSHAKE_TIMEOUT_S = 10.0


class ChannelError(ConnectionError):
    """The replica's channel is not connected (it never came up, or broke)."""


def _proof(secret: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, b"kvrelay-" + role + nonce, hashlib.sha256).digest()


def _frame(msg) -> bytes:
    body = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(body)) + body


# ---- the frontend's end ------------------------------------------------------
class _Peer:
    def __init__(self, replica_id: str, writer: asyncio.StreamWriter):
        self.replica_id = replica_id
        self.writer = writer
        self.requests: set[str] = set()


class ChannelServer:
    """Accepts the replicas' connections; each request opens an inbox that
    receives the events for it from the replicas it runs on (each delta of
    a `Deltas` frame on its own, as a `GenerateDelta`), and `Lost` if one of
    their channels breaks. Event-loop thread only."""

    def __init__(self, secret: bytes, host: str = "127.0.0.1", advertise_host: str | None = None,
                 on_lost: Callable[[str], None] | None = None, ports: tuple[int, int] | None = None):
        self.secret = secret
        self.host = host
        self.advertise_host = advertise_host or host
        self.on_lost = on_lost  # called with the replica id when its channel breaks
        self.ports = ports  # (first, last): listen on the first free one; None: any free port
        self.address: str | None = None  # "host:port" once started
        self._server: asyncio.AbstractServer | None = None
        self._peers: dict[str, _Peer] = {}
        self._inboxes: dict[str, asyncio.Queue] = {}
        self._connected = asyncio.Condition()

    async def start(self) -> str:
        first, last = self.ports or (0, 0)
        for port in range(first, last + 1):
            try:
                self._server = await asyncio.start_server(self._serve, self.host, port)
                break
            except OSError as e:
                if port == last:
                    raise ChannelError(f"network.channel_ports: no free port in {first}-{last} on "
                                       f"{self.host} ({e.strerror or e})") from None
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"{self.advertise_host}:{port}"
        return self.address

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for peer in list(self._peers.values()):
            peer.writer.close()

    def is_connected(self, replica_id: str) -> bool:
        return replica_id in self._peers

    async def wait_connected(self, replica_ids: Iterable[str], timeout_s: float) -> None:
        want = set(replica_ids)
        async with self._connected:
            try:
                await within(self._connected.wait_for(lambda: want <= self._peers.keys()), timeout_s)
            except asyncio.TimeoutError:
                missing = ", ".join(sorted(want - self._peers.keys()))
                raise ChannelError(f"replica(s) {missing} did not connect their request channel to "
                                   f"{self.address} within {timeout_s:.0f}s") from None

    def open(self, request_id: str, replica_ids: Iterable[str]) -> asyncio.Queue:
        """The request's inbox. Raises ChannelError if a replica is not connected."""
        if request_id in self._inboxes:
            raise ValueError(f"request_id: {request_id!r} is already running")
        peers = [self._peer(r) for r in replica_ids]
        inbox: asyncio.Queue = asyncio.Queue()
        self._inboxes[request_id] = inbox
        for p in peers:
            p.requests.add(request_id)
        return inbox

    def close(self, request_id: str) -> None:
        self._inboxes.pop(request_id, None)
        for p in self._peers.values():
            p.requests.discard(request_id)

    def send(self, replica_id: str, msg) -> None:
        """Queue a command for the replica (never blocks). Raises ChannelError if it is not connected."""
        self._peer(replica_id).writer.write(_frame(msg))

    def drop(self, replica_id: str) -> None:
        """Break the replica's channel (it is dead or unwanted): its requests get `Lost`."""
        peer = self._peers.get(replica_id)
        if peer is not None:
            self._lost(peer)
            peer.writer.close()

    def _peer(self, replica_id: str) -> _Peer:
        peer = self._peers.get(replica_id)
        if peer is None:
            raise ChannelError(f"replica {replica_id} has no request channel")
        return peer

    def _lost(self, peer: _Peer) -> None:
        if self._peers.get(peer.replica_id) is not peer:
            return
        del self._peers[peer.replica_id]
        for rid in peer.requests:
            inbox = self._inboxes.get(rid)
            if inbox is not None:
                inbox.put_nowait(Lost(peer.replica_id))
        peer.requests.clear()
        if self.on_lost is not None:
            self.on_lost(peer.replica_id)

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str | None:
        nonce = os.urandom(_NONCE)
        writer.write(nonce)
        await writer.drain()
        proof = await reader.readexactly(_PROOF)
        if not hmac.compare_digest(proof, _proof(self.secret, b"replica", nonce)):
            log.warning("request channel: refused a peer that does not know the cluster secret")
            return None
        their_nonce = await reader.readexactly(_NONCE)
        (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
        if size > 1024:
            return None
        replica_id = (await reader.readexactly(size)).decode()
        writer.write(_proof(self.secret, b"frontend", their_nonce))
        await writer.drain()
        return replica_id

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = None
        try:
            replica_id = await within(self._handshake(reader, writer), HANDSHAKE_TIMEOUT_S)
            if replica_id is None:
                return
            old = self._peers.get(replica_id)
            if old is not None:  # a replica that reconnects replaces its old channel
                self._lost(old)
                old.writer.close()
            peer = _Peer(replica_id, writer)
            self._peers[replica_id] = peer
            async with self._connected:
                self._connected.notify_all()
            while True:
                (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
                if size > MAX_FRAME:
                    log.error("request channel of %s: a frame of %d bytes; dropping the channel", replica_id, size)
                    return
                frame = pickle.loads(await reader.readexactly(size))
                for event in frame.deltas if isinstance(frame, Deltas) else (frame,):
                    inbox = self._inboxes.get(event.request_id)
                    if inbox is not None:
                        inbox.put_nowait(event)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError):
            pass
        except Exception:
            log.exception("request channel: dropped a connection")
        finally:
            if peer is not None:
                self._lost(peer)
            writer.close()


# ---- a replica's end ---------------------------------------------------------
class ChannelClient:
    """A replica's connection to one frontend. ``on_command(client, frame)``
    runs on this client's reader thread for each command frame;
    ``on_lost(client)`` once, when the connection ends. ``send`` is
    thread-safe, never raises and never waits on anything but the socket."""

    def __init__(self, address: str, secret: bytes, replica_id: str,
                 on_command: Callable[["ChannelClient", object], None],
                 on_lost: Callable[["ChannelClient"], None]):
        self.address = address
        self._lock = threading.Lock()
        self._closed = False
        host, port = address.rsplit(":", 1)
        self._sock = socket.create_connection((host, int(port)), timeout=HANDSHAKE_TIMEOUT_S)
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            self._file = self._sock.makefile("rb")
            nonce = self._read(_NONCE)
            mine = os.urandom(_NONCE)
            rid = replica_id.encode()
            self._sock.sendall(_proof(secret, b"replica", nonce) + mine + _LEN.pack(len(rid)) + rid)
            if not hmac.compare_digest(self._read(_PROOF), _proof(secret, b"frontend", mine)):
                raise ChannelError(f"the frontend at {address} does not know the cluster secret")
            self._sock.settimeout(None)
        except BaseException:
            self._sock.close()
            raise
        self._on_command = on_command
        self._on_lost = on_lost
        self._reader = threading.Thread(target=self._read_loop, name=f"{replica_id}-channel", daemon=True)
        self._reader.start()

    def send(self, frame) -> bool:
        """Send one frame; False if the channel is closed (the frame is dropped)."""
        data = _frame(frame)
        with self._lock:
            if self._closed:
                return False
            try:
                self._sock.sendall(data)
                return True
            except OSError as e:
                log.warning("request channel to %s: %s", self.address, e)
                self._shutdown()
                return False

    def close(self) -> None:
        with self._lock:
            self._shutdown()

    def _shutdown(self) -> None:  # lock held
        if not self._closed:
            self._closed = True
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes the reader thread
            except OSError:
                pass

    def _read(self, n: int) -> bytes:
        data = self._file.read(n)
        if data is None or len(data) < n:
            raise ConnectionError("the frontend closed the request channel")
        return data

    def _read_loop(self) -> None:
        try:
            while True:
                (size,) = _LEN.unpack(self._read(_LEN.size))
                if size > MAX_FRAME:
                    log.error("request channel from %s: a frame of %d bytes; closing", self.address, size)
                    return
                msg = pickle.loads(self._read(size))
                try:
                    self._on_command(self, msg)
                except Exception:
                    log.exception("request channel: command %s failed", type(msg).__name__)
        except (ConnectionError, OSError, ValueError):
            pass
        except Exception:
            log.exception("request channel from %s: reader failed", self.address)
        finally:
            self.close()
            self._sock.close()
            self._on_lost(self)
