"""What a sender and a receiver are built from. Plain Python: no torch, no gRPC.

``cluster.spec.split_spec`` builds these from the spec's ``transfer`` section
(tests and the bench build them directly). Each is passed whole, never
unpacked into keyword options: launcher -> stage -> KVSender / KVReceiver ->
link / service. Every field is checked on construction, and a bad value
raises ValueError naming it (``SenderConfig.window ...``).

The cluster secret may be None until it is known: the launcher fills in the
one it makes per deployment with ``dataclasses.replace(config, secret=...)``.
A sender or receiver refuses to start without a secret.
"""
from __future__ import annotations

from dataclasses import dataclass, field

TRANSPORTS = ("grpc", "nccl", "local")
MAX_CHUNK_BYTES = 255 << 20  # a chunk and its header fit in one gRPC message (service.MAX_MESSAGE_BYTES)


@dataclass(frozen=True)
class GrpcLinkConfig:
    """The data path of a sender's grpc links."""

    window: int = 16  # chunks in flight per link
    num_channels: int = 2  # connections per link, each its own TCP socket and Push stream
    stream_idle_s: float = 2.0  # a Push stream closes after this long without a chunk (frees a receiver thread)

    def __post_init__(self) -> None:
        _check_int(self, "window", minimum=1)
        _check_int(self, "num_channels", minimum=1)
        _check_seconds(self, "stream_idle_s")


@dataclass(frozen=True)
class NcclLinkConfig:
    """The data path of a sender's nccl links."""

    window: int = 32  # chunks in flight per link (announced, their send posted, not yet acknowledged)

    def __post_init__(self) -> None:
        _check_int(self, "window", minimum=1)


@dataclass(frozen=True)
class SenderConfig:
    """A prefill replica's KVSender and the links it opens (the endpoint's transport picks ``grpc`` or ``nccl``)."""

    secret: str | bytes | None = field(default=None, repr=False)  # the cluster secret; None: not known yet
    lease_s: float = 30.0  # the prefill stage renews the lease of a request still queued every lease_s / 3
    deadline_s: float = 60.0  # a transfer ends DONE or FAILED within this, from start(); 0: fails at once
    connect_timeout_s: float = 10.0  # to open and authenticate a link
    chunk_timeout_s: float = 30.0  # a chunk the receiver does not acknowledge within this fails its link
    max_chunk_bytes: int = 4 << 20  # per message (a chunk holds at least one block)
    checksum: bool = False  # send each chunk's CRC32, for the receiver to verify
    grpc: GrpcLinkConfig = field(default_factory=GrpcLinkConfig)
    nccl: NcclLinkConfig = field(default_factory=NcclLinkConfig)

    def __post_init__(self) -> None:
        _check_secret(self)
        _check_seconds(self, "lease_s")
        _check_seconds(self, "deadline_s", allow_zero=True)
        _check_seconds(self, "connect_timeout_s")
        _check_seconds(self, "chunk_timeout_s")
        _check_int(self, "max_chunk_bytes", minimum=1, maximum=MAX_CHUNK_BYTES)
        _check_type(self, "checksum", bool)
        _check_type(self, "grpc", GrpcLinkConfig)
        _check_type(self, "nccl", NcclLinkConfig)


@dataclass(frozen=True)
class ReceiverConfig:
    """A decode replica's KVReceiver and the service it hosts (``grpc``, ``nccl``) or registers (``local``)."""

    secret: str | bytes | None = field(default=None, repr=False)  # the cluster secret; None: not known yet
    transport: str = "grpc"  # one of TRANSPORTS; the spec's transfer.backend
    # the address the service listens on; "0.0.0.0": every interface; None: this node's own address
    # (the one its default route leaves by), found where the receiver starts
    host: str | None = "127.0.0.1"
    port: int = 0  # 0: any free port; else the first port to try
    port_max: int | None = None  # the last port to try (from port up); None: port only
    advertise_host: str | None = None  # the host in the endpoint; None: host, or this machine's address
    lease_s: float = 30.0  # reserved blocks whose KV never came are freed after this (unless renewed)
    progress_timeout_s: float = 10.0  # each accepted chunk extends the lease to at least this from now
    chunk_timeout_s: float = 30.0  # nccl: how long an announced chunk's bytes (and a pair's group) may take
    max_workers: int = 256  # the service's handler threads (see KVReceiver)

    def __post_init__(self) -> None:
        _check_secret(self)
        if self.transport not in TRANSPORTS:
            raise ValueError(f"ReceiverConfig.transport: must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.host is not None:
            _check_type(self, "host", str)
        _check_int(self, "port", minimum=0, maximum=65535)
        if self.port_max is not None:
            _check_int(self, "port_max", minimum=max(1, self.port), maximum=65535)
        if self.advertise_host is not None:
            _check_type(self, "advertise_host", str)
        _check_seconds(self, "lease_s")
        _check_seconds(self, "progress_timeout_s")
        _check_seconds(self, "chunk_timeout_s")
        _check_int(self, "max_workers", minimum=1)


def _name(config, name: str) -> str:
    return f"{type(config).__name__}.{name}"


def _check_type(config, name: str, kind: type) -> None:
    value = getattr(config, name)
    if not isinstance(value, kind):
        raise ValueError(f"{_name(config, name)}: must be a {kind.__name__}, got {value!r}")


def _check_int(config, name: str, minimum: int, maximum: int | None = None) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{_name(config, name)}: must be an int, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{_name(config, name)}: must be {bounds}, got {value}")


def _check_seconds(config, name: str, allow_zero: bool = False) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{_name(config, name)}: must be a number of seconds, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero) or value != value:
        raise ValueError(f"{_name(config, name)}: must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def _check_secret(config) -> None:
    secret = config.secret
    if secret is not None and not isinstance(secret, (str, bytes)):
        raise ValueError(f"{_name(config, 'secret')}: must be a str or bytes, got {type(secret).__name__}")
    if secret is not None and not secret:
        raise ValueError(f"{_name(config, 'secret')}: must not be empty (None until the launcher fills it in)")
