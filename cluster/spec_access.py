"""The cluster spec's sections on who reaches a deployment and how (`cluster.spec` holds the rest):
where the cluster's own listeners bind (``network``), the client-facing frontends and their TLS
(``frontend``), and the API keys and cluster secret (``auth``), each resolved from its source with
an error that names the field."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from cluster.spec_base import Strict
from cluster.spec_errors import SpecError


class PortRange(Strict):
    """Ports ``first`` to ``last``, both included; each listener takes the first free one."""

    first: int = Field(ge=1, le=65535)
    last: int = Field(ge=1, le=65535)

    @model_validator(mode="after")
    def _ordered(self) -> "PortRange":
        if self.last < self.first:
            raise ValueError(f"last ({self.last}) must be >= first ({self.first})")
        return self


class NetworkSpec(Strict):
    """Where the cluster's own listeners bind (not the frontends: see ``frontend``).

    Two kinds, both refusing any peer that does not prove the cluster secret:
    the request channel (one, in the frontend's process; every replica dials
    it) and the KV receiver (one per decode replica; prefill replicas dial
    it). ``host`` None binds loopback when kvrelay starts its own Ray, and
    the node's own address when joined to a Ray cluster; ``0.0.0.0`` binds
    every interface. Port ranges let a firewall open exactly these ports;
    a range must hold one port per listener on a node (e.g. its decode
    replicas). deploy/README.md says what must be reachable from where.
    """

    host: str | None = Field(None, min_length=1, max_length=253)
    channel_ports: PortRange | None = None  # None: any free port
    kv_ports: PortRange | None = None  # None: any free port


class TLSSpec(Strict):
    cert_file: str
    key_file: str


class FrontendSpec(Strict):
    host: str = Field("127.0.0.1", min_length=1, max_length=253)  # "0.0.0.0": every interface (opt in)
    grpc_port: int = Field(50051, ge=0, le=65535)  # 0: any free port
    http_port: int | None = Field(8000, ge=0, le=65535)  # None: no OpenAI HTTP frontend
    tls: TLSSpec | None = None
    health_interval_s: float = Field(1.0, gt=0, le=60)  # gRPC health re-checks the replicas this often
    # Frontend processes for one deployment, each serving gRPC and HTTP with its own router view. 1: the
    # `kvrelay serve` process serves; N > 1: N frontend actors on the node that runs `kvrelay serve`.
    replicas: int = Field(1, ge=1, le=64)
    # N > 1: every frontend on the same two ports (SO_REUSEPORT; the kernel spreads connections), or,
    # when false, frontend i on grpc_port + i and http_port + i (each scraped and addressed on its own).
    reuse_port: bool = True
    # how the model writes tool calls (cluster.tools): auto reads it from the chat template
    tool_call_format: Literal["auto", "hermes", "llama3"] = "auto"

    @model_validator(mode="after")
    def _distinct_ports(self) -> "FrontendSpec":
        if self.http_port is not None and self.http_port == self.grpc_port != 0:
            raise ValueError(f"grpc_port and http_port must differ (both {self.grpc_port})")
        if self.replicas > 1 and not self.reuse_port and self.http_port is not None and 0 not in (
                self.grpc_port, self.http_port):
            grpc_ports = range(self.grpc_port, self.grpc_port + self.replicas)
            http_ports = range(self.http_port, self.http_port + self.replicas)
            if set(grpc_ports) & set(http_ports):
                raise ValueError(f"with {self.replicas} frontends and reuse_port false, gRPC ports "
                                 f"{grpc_ports.start}-{grpc_ports.stop - 1} and HTTP ports "
                                 f"{http_ports.start}-{http_ports.stop - 1} overlap")
        if self.replicas > 1 and not self.reuse_port and max(self.grpc_port, self.http_port or 0) \
                + self.replicas - 1 > 65535:
            raise ValueError(f"{self.replicas} frontends from port {max(self.grpc_port, self.http_port or 0)} "
                             "run past 65535")
        return self


class AuthSpec(Strict):
    """API keys for clients and the secret the KV transfer handshake checks.

    API keys come from at most one source: ``api_keys`` inline, an environment
    variable holding comma-separated keys, or a file with one key a line
    (``#`` comments allowed). No keys: the frontends accept every client.
    The cluster secret comes from an environment variable or a file; with
    neither, the launcher makes a random one per deployment.
    """

    api_keys: list[str] = Field(default_factory=list)
    api_keys_env: str | None = None
    api_keys_file: str | None = None
    cluster_secret_env: str | None = None
    cluster_secret_file: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> "AuthSpec":
        sources = [n for n in ("api_keys", "api_keys_env", "api_keys_file") if getattr(self, n)]
        if len(sources) > 1:
            raise ValueError(f"give at most one of api_keys, api_keys_env, api_keys_file (got {', '.join(sources)})")
        if self.cluster_secret_env and self.cluster_secret_file:
            raise ValueError("give at most one of cluster_secret_env, cluster_secret_file")
        if any(not k.strip() for k in self.api_keys):
            raise ValueError("api_keys: keys must be non-empty")
        return self

    def resolve_api_keys(self) -> list[str]:
        """The configured API keys (empty: no auth). Raises SpecError naming a missing env var or file."""
        if self.api_keys:
            return list(self.api_keys)
        if self.api_keys_env:
            raw = _read_env("auth.api_keys_env", self.api_keys_env)
            keys = [k.strip() for k in raw.split(",") if k.strip()]
        elif self.api_keys_file:
            raw = _read_file("auth.api_keys_file", self.api_keys_file)
            keys = [ln.strip() for ln in raw.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        else:
            return []
        if not keys:
            where = self.api_keys_env or self.api_keys_file
            raise SpecError([f"auth: no API keys found in {where}"])
        return keys

    def resolve_cluster_secret(self) -> str | None:
        """The cluster secret, or None when the spec sets no source."""
        if self.cluster_secret_env:
            secret = _read_env("auth.cluster_secret_env", self.cluster_secret_env).strip()
        elif self.cluster_secret_file:
            secret = _read_file("auth.cluster_secret_file", self.cluster_secret_file).strip()
        else:
            return None
        if not secret:
            raise SpecError([f"auth: the cluster secret in {self.cluster_secret_env or self.cluster_secret_file} is empty"])
        return secret


def _read_env(path: str, name: str) -> str:
    value = os.environ.get(name)
    if value is None:
        raise SpecError([f"{path}: environment variable {name} is not set"])
    return value


def _read_file(path: str, filename: str) -> str:
    try:
        return Path(filename).expanduser().read_text()
    except OSError as e:
        raise SpecError([f"{path}: cannot read {filename}: {e.strerror or e}"]) from None
