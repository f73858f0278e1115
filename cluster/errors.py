"""How a failure reaches a client: one table for both frontends.

    what failed                                   gRPC                 HTTP
    bad input (InvalidRequestError)               INVALID_ARGUMENT     400 (404 for an unknown model)
    over capacity (OverloadedError)               RESOURCE_EXHAUSTED   429
    no replica (NoReplicaError), a failure
      inside the cluster (an exception from the
      backend, a last delta with FinishReason.ERROR) UNAVAILABLE       503
    a deadline passed (TimeoutError)              DEADLINE_EXCEEDED    504

HTTP 500 (gRPC UNKNOWN) is left for a bug in the frontend itself. Messages
that reach a client are clipped (`clip`), and values they quote are
shortened (`quote`), so an error never grows with the input: a gRPC
trailer past the client's metadata limit would turn INVALID_ARGUMENT into
RESOURCE_EXHAUSTED.
"""
from __future__ import annotations

import enum
import logging
import reprlib
import threading
import time
from dataclasses import dataclass

from cluster.types import InvalidRequestError, NoReplicaError, OverloadedError

MAX_MESSAGE_CHARS = 1024  # an error message a client gets, at most
MAX_QUOTE_CHARS = 64  # a value quoted inside one, at most


class Code(enum.Enum):
    """A failure's status: the gRPC code's name, the HTTP status, OpenAI's error type and code."""

    INVALID_ARGUMENT = ("INVALID_ARGUMENT", 400, "invalid_request_error", None)
    RESOURCE_EXHAUSTED = ("RESOURCE_EXHAUSTED", 429, "rate_limit_error", "overloaded")
    UNAVAILABLE = ("UNAVAILABLE", 503, "service_unavailable_error", "unavailable")
    DEADLINE_EXCEEDED = ("DEADLINE_EXCEEDED", 504, "timeout_error", "deadline_exceeded")

    def __init__(self, grpc_name: str, http_status: int, openai_type: str, openai_code: str | None):
        self.grpc_name = grpc_name
        self.http_status = http_status
        self.openai_type = openai_type
        self.openai_code = openai_code


@dataclass(frozen=True)
class Failure:
    """What a client is told: a code and a clipped message (``field`` for bad input)."""

    code: Code
    message: str
    field: str | None = None
    openai_code: str | None = None  # overrides the code's own (e.g. no_replica)
    is_unexpected: bool = False  # an exception no refusal explains: the log should get its trace

    @property
    def is_retryable(self) -> bool:
        return self.code in (Code.RESOURCE_EXHAUSTED, Code.UNAVAILABLE)


def classify(exc: BaseException) -> Failure:
    """The failure an exception from the backend (or validation) stands for."""
    if isinstance(exc, InvalidRequestError):
        return Failure(Code.INVALID_ARGUMENT, clip(str(exc)), exc.field)
    if isinstance(exc, OverloadedError):
        return Failure(Code.RESOURCE_EXHAUSTED, clip(str(exc)))
    if isinstance(exc, NoReplicaError):
        return Failure(Code.UNAVAILABLE, clip(str(exc)), openai_code="no_replica")
    if isinstance(exc, TimeoutError):
        return Failure(Code.DEADLINE_EXCEEDED, clip(f"request timed out: {exc}" if str(exc) else "request timed out"))
    return Failure(Code.UNAVAILABLE, clip(f"request failed: {type(exc).__name__}: {exc}"), openai_code="request_failed",
                   is_unexpected=True)


def request_failed(error: str | None) -> Failure:
    """A request that failed inside the cluster (its last delta has FinishReason.ERROR)."""
    return Failure(Code.UNAVAILABLE, clip(f"request failed: {error or 'unknown error'}"), openai_code="request_failed")


def clip(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` cut to at most ``limit`` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    tail = f"... ({len(text) - limit} more characters)"
    return text[:max(0, limit - len(tail))] + tail


def quote(value: object, limit: int = MAX_QUOTE_CHARS) -> str:
    """``repr(value)``, shortened to about ``limit`` characters, for quoting input inside an error.

    Bounded in time too: containers are shown a few levels and items deep
    (YAML aliases can make a small file a huge or deep object).
    """
    short = reprlib.Repr()
    short.maxlevel = 3
    short.maxtuple = short.maxlist = short.maxarray = short.maxdict = short.maxset = short.maxfrozenset = 4
    short.maxdeque = 4
    short.maxstring = short.maxlong = short.maxother = limit
    try:
        text = short.repr(value)
    except (ValueError, RecursionError):  # an int past Python's limit on digits
        return f"<a {type(value).__name__} too long to show>"
    if isinstance(value, str) and len(value) > limit:
        return f"{text}... ({len(value)} characters)"
    if len(text) <= limit + 8:
        return text
    return f"{text[:limit]}..."


class RateLimitedLog:
    """Logs at most once per ``interval_s``; the next line says how many were held back.

    For what a client can cause at will (junk bytes, bad calls): one line a
    while, never a line (or a traceback) per call.
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 60.0, level: int = logging.WARNING):
        self.logger = logger
        self.interval_s = interval_s
        self.level = level
        self._lock = threading.Lock()
        self._next_at = 0.0
        self.num_suppressed = 0

    def __call__(self, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless one was logged within the interval; True if it was logged."""
        with self._lock:
            now = time.monotonic()
            if now < self._next_at:
                self.num_suppressed += 1
                return False
            suppressed, self.num_suppressed = self.num_suppressed, 0
            self._next_at = now + self.interval_s
        if suppressed:
            msg += f" ({suppressed} more like it since the last such line)"
        self.logger.log(self.level, msg, *args)
        return True
