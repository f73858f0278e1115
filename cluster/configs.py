"""The per-component configs a deployment is cut into (`cluster.spec.split_spec`).

Plain frozen dataclasses, with nothing of the YAML schema's validation: the launcher,
the frontends and the replicas each take the one config they need from here, so none
of them depends on the spec's schema (`cluster.spec`) or sees the whole spec.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from cluster.replicas import HealthConfig
from cluster.router import RouterConfig
from cluster.types import Stage
from engine.config import EngineConfig
from kvtransfer.config import ReceiverConfig, SenderConfig


@dataclass(frozen=True)
class StageConfig:
    """What the launcher needs to start one stage's replicas."""

    stage: Stage
    num_replicas: int
    tensor_parallel_size: int
    ray_options: dict[str, Any]  # num_cpus / num_gpus / resources of each worker (each rank)
    engine: EngineConfig
    placement_strategy: str = "STRICT_PACK"  # of a tensor-parallel replica's placement group
    placement_timeout_s: float = 60.0
    pipeline_parallel_size: int = 1
    pipeline_layer_split: tuple[int, ...] | None = None

    @property
    def num_ranks(self) -> int:
        """Ranks of one replica, rank = pp_rank * tp + tp_rank: its placement group's bundles, one each."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class TransferConfig:
    """The config of every prefill replica's KV sender and every decode replica's KV receiver.

    Their secret is None when the spec names no source of it: the launcher then
    makes one per deployment and fills it in (``with_secret``).
    """

    sender: SenderConfig
    receiver: ReceiverConfig

    def with_secret(self, secret: str) -> "TransferConfig":
        return TransferConfig(replace(self.sender, secret=secret), replace(self.receiver, secret=secret))


@dataclass(frozen=True)
class FrontendConfig:
    host: str = "127.0.0.1"
    grpc_port: int = 0
    http_port: int | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    api_keys: tuple[str, ...] = ()  # empty: no auth
    health_interval_s: float = 1.0  # gRPC health follows the replicas' liveness this often
    replicas: int = 1  # frontend processes (`FrontendSpec.replicas`)
    reuse_port: bool = False  # share the ports with the deployment's other frontends (SO_REUSEPORT)
    tool_call_format: str = "auto"  # auto | hermes | llama3 (cluster.tools)


@dataclass(frozen=True)
class NetworkConfig:
    """Where the request channel and the KV receivers bind (`NetworkSpec`); the launcher applies it.

    ``host`` None: loopback when kvrelay started its own Ray, else the node's
    own address (each receiver finds its node's where it starts).
    """

    host: str | None = None
    channel_ports: tuple[int, int] | None = None  # (first, last); None: any free port
    kv_ports: tuple[int, int] | None = None

    def receiver_config(self, receiver: ReceiverConfig, is_joined: bool) -> ReceiverConfig:
        """``receiver`` with this bind address and port range."""
        host = self.host if self.host is not None else (None if is_joined else "127.0.0.1")
        first, last = self.kv_ports or (0, None)
        return replace(receiver, host=host, port=first, port_max=last)

    def channel_bind(self, is_joined: bool, node_address: str) -> tuple[str, str | None, tuple[int, int] | None]:
        """The request channel's (bind host, advertised host or None, port range or None)."""
        if self.host is not None:
            host = self.host
        else:
            host = node_address if is_joined else "127.0.0.1"
        advertise = node_address if host in ("0.0.0.0", "::") else None
        return host, advertise, self.channel_ports


@dataclass(frozen=True)
class ProfileConfig:
    out_dir: str
    seconds: float
    delay_s: float = 0.0
    with_stack: bool = False


@dataclass(frozen=True)
class ClusterConfig:
    model: str
    dtype: str
    mode: str
    stages: dict[Stage, StageConfig]
    transfer: TransferConfig
    router: RouterConfig
    frontend: FrontendConfig
    ray_address: str | None
    ray_namespace: str
    profile: ProfileConfig | None = None  # a profiler window at startup
    health: HealthConfig = HealthConfig()
    network: NetworkConfig = NetworkConfig()
