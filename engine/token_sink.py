"""A fast path for each request's first token, from a stage replica straight
to the frontend that placed it.

The token still travels the normal way too (the replica's result or its Ray
stream): the sink only gets it there sooner, skipping the Ray hops that sit
between a replica's loop thread and the frontend's event loop. The frontend
takes whichever copy comes first, so a lost or refused connection costs time,
never the token.

Wire: the server sends a 16-byte nonce; the client answers with
HMAC-SHA256(secret, "kvrelay-token-sink" || nonce) (the secret never
crosses the wire); then the client sends frames, a 4-byte big-endian length
and a JSON `FirstToken`. Frames for ids the server does not wait on are
dropped.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import socket
import struct
import threading
import time
from dataclasses import asdict, dataclass

log = logging.getLogger(__name__)

_LEN = struct.Struct(">I")
_NONCE_BYTES = 16
_MAX_FRAME = 1 << 20
_RETRY_AFTER_S = 5.0  # after a failed connect or send, how long a client leaves that sink alone


@dataclass
class FirstToken:
    """A request's first output token, as its replica sampled it. ``text`` is
    what the replica's detokenizer emits for it (text that may start a stop
    string is held back); ``logprobs`` is set when the request asked for them:
    ``{"token_logprob": float, "top": [[token_id, logprob], ...]}``."""

    request_id: str
    token_id: int
    text: str = ""
    logprobs: dict | None = None


def _proof(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, b"kvrelay-token-sink" + nonce, hashlib.sha256).digest()


class TokenSinkServer:
    """The frontend's end: waits on request ids, resolves their futures (event-loop thread only)."""

    def __init__(self, secret: bytes, host: str = "127.0.0.1", advertise_host: str | None = None):
        self.secret = secret
        self.host = host
        self.advertise_host = advertise_host or host
        self.address: str | None = None  # "host:port" once started
        self._waiting: dict[str, asyncio.Future] = {}
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"{self.advertise_host}:{port}"
        return self.address

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def wait(self, request_id: str) -> asyncio.Future:
        """A future for the request's `FirstToken`; `discard` it when done."""
        fut = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = fut
        return fut

    def discard(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            nonce = os.urandom(_NONCE_BYTES)
            writer.write(nonce)
            await writer.drain()
            proof = await asyncio.wait_for(reader.readexactly(32), 5.0)
            if not hmac.compare_digest(proof, _proof(self.secret, nonce)):
                log.warning("token sink: refused a peer that does not know the secret")
                return
            while True:
                (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
                if size > _MAX_FRAME:
                    log.warning("token sink: frame of %d bytes refused", size)
                    return
                first = FirstToken(**json.loads(await reader.readexactly(size)))
                fut = self._waiting.get(first.request_id)
                if fut is not None and not fut.done():
                    fut.set_result(first)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError):
            pass
        except Exception:
            log.exception("token sink: dropped a connection")
        finally:
            writer.close()


class TokenSinkClient:
    """A replica's end: one connection per sink, used from the replica's loop
    thread. Never raises and never blocks for long: a sink it cannot reach is
    left alone for a while (the token still goes the normal way)."""

    def __init__(self):
        self._secrets: dict[str, bytes] = {}
        self._socks: dict[str, socket.socket] = {}
        self._down_until: dict[str, float] = {}
        self._lock = threading.Lock()

    def register(self, address: str, secret: bytes) -> None:
        with self._lock:
            self._secrets[address] = secret

    def send(self, address: str, first: FirstToken) -> bool:
        try:
            body = json.dumps(asdict(first)).encode()
        except (TypeError, ValueError) as e:
            log.warning("token sink: cannot encode the first token of %s: %s", first.request_id, e)
            return False
        with self._lock:
            if address not in self._secrets or time.monotonic() < self._down_until.get(address, 0.0):
                return False
            try:
                sock = self._socks.get(address) or self._connect(address)
                sock.sendall(_LEN.pack(len(body)) + body)
                return True
            except OSError as e:
                log.warning("token sink %s: %s; tokens go the normal way for %.0fs", address, e, _RETRY_AFTER_S)
                self._drop(address)
                self._down_until[address] = time.monotonic() + _RETRY_AFTER_S
                return False

    def close(self) -> None:
        with self._lock:
            for address in list(self._socks):
                self._drop(address)

    def _connect(self, address: str) -> socket.socket:  # lock held
        host, port = address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=1.0)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = b""
            while len(nonce) < _NONCE_BYTES:
                chunk = sock.recv(_NONCE_BYTES - len(nonce))
                if not chunk:
                    raise ConnectionError("the sink closed the connection")
                nonce += chunk
            sock.sendall(_proof(self._secrets[address], nonce))
        except BaseException:
            sock.close()
            raise
        self._socks[address] = sock
        return sock

    def _drop(self, address: str) -> None:  # lock held
        sock = self._socks.pop(address, None)
        if sock is not None:
            sock.close()
