"""The YAML cluster spec: one file describes a deployment.

The spec is validated once, on load; every problem is reported with its path
(``decode.replicas: must be >= 1``) in one `SpecError` (`cluster.spec_errors`;
the file's YAML is read by `cluster.spec_yaml`; the network, frontend and
auth sections are `cluster.spec_access`'s). `split_spec` then cuts
it into the small configs each component gets (`cluster.configs`), so no
component sees the whole spec.

Example (every field has a default, so ``{}`` is a valid spec)::

    model: SmolLM2-135M-Instruct
    mode: disaggregated
    prefill: {replicas: 1, resources: {num_cpus: 2}}
    decode:  {replicas: 1, num_kv_blocks: 512}
    transfer: {backend: grpc}
    router: {policy: least_loaded}
    frontend: {grpc_port: 50051, http_port: 8000}   # host 127.0.0.1 unless it says 0.0.0.0
    network: {kv_ports: {first: 30100, last: 30131}}
"""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from cluster.configs import (ClusterConfig, FrontendConfig, NetworkConfig, ProfileConfig, StageConfig,
                             TransferConfig)
from cluster.replicas import HealthConfig
from cluster.router import RouterConfig
from cluster.spec_access import AuthSpec, FrontendSpec, NetworkSpec
from cluster.spec_base import Strict
from cluster.spec_errors import SpecError, format_errors
from cluster.spec_tp import check_fits_model
from cluster.spec_yaml import MAX_SPEC_BYTES, read_yaml
from cluster.types import Stage
from engine.config import EngineConfig
from kvtransfer.config import MAX_CHUNK_BYTES, GrpcLinkConfig, NcclLinkConfig, ReceiverConfig, SenderConfig
from kvtransfer.layout import DECODE_PP_REASON

DEFAULT_MODEL = "SmolLM2-135M-Instruct"

# Upper bounds: past these a value is a typo or an attack, not a deployment
# (and some would overflow a C int or a timer). Floats must be finite.
MAX_SECONDS = 7 * 24 * 3600.0
MAX_REPLICAS = 4096
MAX_CPUS = 1 << 16
MAX_GPUS = 1 << 12
MAX_LAYERS = 1 << 16
MAX_SEQS = 1 << 16
MAX_TOKENS = 1 << 24  # batched tokens per step, or a model's context
MAX_BLOCK_SIZE = 1 << 12
MAX_KV_BLOCKS = 1 << 28
MAX_MEMORY_GB = float(1 << 16)
MAX_THREADS = 1 << 14
MAX_WINDOW = 1 << 14
MAX_CHANNELS = 256
MAX_QUEUE = 1 << 24
MAX_SEED = (1 << 63) - 1


class Resources(Strict):
    """Ray resources of one worker process (one per tensor-parallel rank)."""

    num_cpus: float = Field(1.0, ge=0, le=MAX_CPUS)
    num_gpus: float = Field(0.0, ge=0, le=MAX_GPUS)
    custom: dict[str, float] = Field(default_factory=dict)  # e.g. {"node:10.0.0.2": 0.01}

    @field_validator("custom")
    @classmethod
    def _non_negative(cls, v: dict[str, float]) -> dict[str, float]:
        bad = [k for k, amount in v.items() if amount < 0]
        if bad:
            raise ValueError(f"amounts must be >= 0 (bad: {', '.join(bad)})")
        return v


class StageSpec(Strict):
    """One stage's replicas and the engine knobs of each replica.

    Give ``num_kv_blocks`` or ``kv_cache_memory_gb``, not both; with neither,
    the engine sizes its cache from its default memory budget.
    """

    replicas: int = Field(1, ge=1, le=MAX_REPLICAS)
    # Tensor parallelism: a replica of N ranks is N Ray actors in one placement group, one bundle
    # of `resources` per rank (cluster.tp_ranks). The ranks share memory, so they need one host:
    # STRICT_PACK guarantees it; PACK is checked once placed; the spreading strategies are refused.
    tensor_parallel_size: int = Field(1, ge=1, le=MAX_GPUS)
    # Pipeline parallelism: the layers split into this many contiguous ranges, one per stage of
    # ranks, even by default or `pipeline_layer_split`'s counts (summing to the model's layers,
    # checked where the model is read: cluster.spec_tp). A replica is pipeline_parallel_size x
    # tensor_parallel_size ranks, one bundle of `resources` each. A decode stage stays at 1
    # (kvtransfer.layout.DECODE_PP_REASON).
    pipeline_parallel_size: int = Field(1, ge=1, le=MAX_GPUS)
    pipeline_layer_split: list[Annotated[int, Field(ge=1, le=MAX_LAYERS)]] | None = Field(None, max_length=MAX_GPUS)
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"
    placement_timeout_s: float = Field(60.0, gt=0, le=MAX_SECONDS)  # `serve` fails if not placed by then
    # the all-reduce between the ranks (engine.parallel): auto is shm on CPU replicas, nccl on GPU ones
    tp_backend: Literal["auto", "shm", "gloo", "nccl"] = "auto"
    tp_timeout_s: float = Field(60.0, gt=0, le=MAX_SECONDS)  # a collective that waits longer fails the replica
    resources: Resources = Field(default_factory=Resources)  # of each rank
    max_num_seqs: int = Field(64, ge=1, le=MAX_SEQS)
    max_num_batched_tokens: int = Field(2048, ge=1, le=MAX_TOKENS)
    block_size: int = Field(16, ge=1, le=MAX_BLOCK_SIZE)
    num_kv_blocks: int | None = Field(None, ge=1, le=MAX_KV_BLOCKS)
    kv_cache_memory_gb: float | None = Field(None, gt=0, le=MAX_MEMORY_GB)
    max_model_len: int | None = Field(None, ge=1, le=MAX_TOKENS)
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # GPU replicas: no CUDA graphs for decode steps
    # CPU replicas: write every page of the KV cache at start, so that a cache the machine cannot hold
    # fails at start rather than under load, and no request pays the first write's page faults
    kv_cache_prefault: bool = True
    # matmul weights kept quantized on CPU replicas (engine.config.EngineConfig.quantization)
    quantization: Literal["none", "int8", "gguf"] = "none"
    # CPU replicas' native kernels: the best this CPU runs (auto), one instruction set by name (a
    # replica fails at start, naming it, where the CPU lacks it), or none (torch's own ops)
    kernel_isa: Literal["auto", "avx512bf16", "avx512", "avx2", "none"] = "auto"
    # a mixture of experts at tensor_parallel_size > 1: split the experts across the ranks
    # (attention stays tensor-parallel), which rank holds which, and how tokens meet their experts
    # (allreduce, or alltoall: a real dispatch, expert parallelism only; engine/parallel/moe.py says
    # when each pays off). Per stage: a prefill stage and a decode stage may choose differently.
    enable_expert_parallel: bool = False
    expert_placement: Literal["contiguous", "round_robin"] = "contiguous"
    moe_dispatch: Literal["allreduce", "alltoall"] = "allreduce"

    @field_validator("placement_strategy")
    @classmethod
    def _one_host(cls, v: str, info: ValidationInfo) -> str:
        ranks = info.data.get("tensor_parallel_size", 1) * info.data.get("pipeline_parallel_size", 1)
        if ranks > 1 and v in ("SPREAD", "STRICT_SPREAD"):
            raise ValueError(f"{v} may put the {ranks} ranks on different hosts, and they share memory "
                             "(one host): use STRICT_PACK or PACK")
        return v

    @field_validator("pipeline_layer_split")
    @classmethod
    def _one_count_per_stage(cls, v: list[int] | None, info: ValidationInfo) -> list[int] | None:
        pp = info.data.get("pipeline_parallel_size", 1)
        if v is not None and len(v) != pp:
            raise ValueError(f"{len(v)} counts for pipeline_parallel_size {pp}; give one per pipeline stage")
        return v

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"must be a power of two, got {v}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "StageSpec":
        if self.num_kv_blocks is not None and self.kv_cache_memory_gb is not None:
            raise ValueError("give num_kv_blocks or kv_cache_memory_gb, not both")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) "
                             f"must be >= block_size ({self.block_size})")
        tp, gpus = self.tensor_parallel_size, self.resources.num_gpus
        if self.num_ranks > 1 and 0 < gpus < 1:
            raise ValueError(f"{self._ranks_name} with resources.num_gpus {gpus:g}: each rank needs a "
                             "GPU of its own (num_gpus >= 1 per rank)")
        if self.tp_backend == "nccl" and gpus == 0:
            raise ValueError("tp_backend: nccl needs device: cuda (resources.num_gpus > 0)")
        if tp > 1 and self.tp_backend in ("shm", "gloo") and gpus > 0:
            raise ValueError(f"tp_backend: {self.tp_backend} sums host memory and the replica is on GPUs "
                             f"(resources.num_gpus {gpus:g}): use nccl (or auto)")
        if self.pipeline_parallel_size > 1 and self.tp_backend in ("shm", "gloo") and gpus > 0:
            raise ValueError(f"tp_backend: {self.tp_backend} hands the stages' activations on through host memory "
                             f"and the replica is on GPUs (resources.num_gpus {gpus:g}): use nccl (or auto) at "
                             f"pipeline_parallel_size {self.pipeline_parallel_size}")
        if self.moe_dispatch == "alltoall" and (tp == 1 or not self.enable_expert_parallel):
            raise ValueError("moe_dispatch: 'alltoall' sends each token to the rank holding its experts, so it "
                             f"needs enable_expert_parallel at tensor_parallel_size > 1 (got tensor_parallel_size "
                             f"{tp}, enable_expert_parallel {self.enable_expert_parallel}); use 'allreduce'")
        return self

    @property
    def num_ranks(self) -> int:
        """Ranks of one replica (one process and one placement bundle each)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def _ranks_name(self) -> str:
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        return f"tensor_parallel_size {tp}" if pp == 1 else \
            f"pipeline_parallel_size {pp} x tensor_parallel_size {tp}"

    def engine_config(self, dtype: str, seed: int = 0) -> EngineConfig:
        kwargs: dict[str, Any] = {}
        if self.kv_cache_memory_gb is not None:
            kwargs["kv_cache_memory_gb"] = self.kv_cache_memory_gb
        return EngineConfig(
            dtype=dtype,
            device="cuda" if self.resources.num_gpus > 0 else "cpu",
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_caching=self.enable_prefix_caching,
            enforce_eager=self.enforce_eager,
            kv_cache_prefault=self.kv_cache_prefault,
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            pipeline_layer_split=tuple(self.pipeline_layer_split) if self.pipeline_layer_split else None,
            tp_backend=self.tp_backend,
            tp_timeout_s=self.tp_timeout_s,
            quantization=self.quantization,
            kernel_isa=self.kernel_isa,
            enable_expert_parallel=self.enable_expert_parallel,
            expert_placement=self.expert_placement,
            moe_dispatch=self.moe_dispatch,
            seed=seed,
            **kwargs,
        )


class TransferOptions(Strict):
    """Every knob of the KV transfer; each goes to the senders' or the receivers' config, or both."""

    lease_s: float = Field(30.0, gt=0, le=MAX_SECONDS)  # reserved blocks whose KV never came are freed after this
    deadline_s: float = Field(60.0, gt=0, le=MAX_SECONDS)  # a transfer ends DONE or FAILED within this
    checksum: bool = False  # verify each chunk's checksum on receipt
    # a sender opening and authenticating a link to a receiver
    connect_timeout_s: float = Field(10.0, gt=0, le=MAX_SECONDS)
    # a chunk the receiver does not acknowledge within this fails its link (nccl: the receiver waits
    # as long for an announced chunk's bytes)
    chunk_timeout_s: float = Field(30.0, gt=0, le=MAX_SECONDS)
    max_chunk_bytes: int = Field(4 << 20, ge=1, le=MAX_CHUNK_BYTES)  # per message; a chunk holds at least one block
    # each chunk that lands extends the lease to at least this
    progress_timeout_s: float = Field(10.0, gt=0, le=MAX_SECONDS)
    # a receiver's handler threads: one per open grpc Push stream or call
    max_workers: int = Field(256, ge=1, le=MAX_THREADS)
    # chunks in flight per link; None: the backend's own (grpc 16, nccl 32)
    window: int | None = Field(None, ge=1, le=MAX_WINDOW)
    # grpc: connections per link, each its own socket and Push stream
    num_channels: int = Field(2, ge=1, le=MAX_CHANNELS)
    # grpc: a Push stream closes after this long without a chunk
    stream_idle_s: float = Field(2.0, gt=0, le=MAX_SECONDS)


_BACKEND_OPTIONS = {"window": ("grpc", "nccl"), "num_channels": ("grpc",), "stream_idle_s": ("grpc",)}


class TransferSpec(Strict):
    backend: Literal["nccl", "grpc", "local"] = "grpc"
    options: TransferOptions = Field(default_factory=TransferOptions)

    def unused_options(self) -> list[str]:
        """``"transfer.options.<name>: ..."`` for each option set that this backend does not use."""
        problems = []
        for name in sorted(self.options.model_fields_set):
            backends = _BACKEND_OPTIONS.get(name, (self.backend,))
            if self.backend not in backends:
                problems.append(f"transfer.options.{name}: only backend {' or '.join(backends)} uses it, "
                                f"not {self.backend!r}; remove it")
        return problems

    def transfer_config(self, secret: str | None) -> TransferConfig:
        """The senders' and receivers' configs (``secret`` None: the launcher fills it in)."""
        o = self.options
        grpc = GrpcLinkConfig(num_channels=o.num_channels, stream_idle_s=o.stream_idle_s)
        nccl = NcclLinkConfig()
        if o.window is not None:
            grpc, nccl = replace(grpc, window=o.window), replace(nccl, window=o.window)
        sender = SenderConfig(secret, lease_s=o.lease_s, deadline_s=o.deadline_s,
                              connect_timeout_s=o.connect_timeout_s, chunk_timeout_s=o.chunk_timeout_s,
                              max_chunk_bytes=o.max_chunk_bytes, checksum=o.checksum, grpc=grpc, nccl=nccl)
        receiver = ReceiverConfig(secret, self.backend, lease_s=o.lease_s, progress_timeout_s=o.progress_timeout_s,
                                  chunk_timeout_s=o.chunk_timeout_s, max_workers=o.max_workers)
        return TransferConfig(sender, receiver)


class RouterSpec(Strict):
    policy: Literal["round_robin", "least_loaded", "power_of_two", "prefix_aware"] = "least_loaded"
    max_queue: int = Field(256, ge=0, le=MAX_QUEUE)  # requests waiting for capacity; 0 refuses at once
    queue_timeout_s: float = Field(30.0, gt=0, le=MAX_SECONDS)
    max_inflight_per_replica: int | None = Field(None, ge=1, le=MAX_SEQS)  # None: the stage's max_num_seqs
    seed: int = Field(0, ge=0, le=MAX_SEED)  # power_of_two's RNG
    # A request whose replica dies, stalls or fails its KV transfer is placed
    # again on a healthy pair, resuming after the tokens its client has, up to
    # this many times (0: never; the request then ends UNAVAILABLE).
    migration_limit: int = Field(3, ge=0, le=100)
    # ... and only while it has produced at most this many tokens (each
    # migration computes them again with the prompt)
    migration_max_tokens: int = Field(8192, ge=0, le=1 << 24)


class HealthSpec(Strict):
    """How the frontend watches the replicas and replaces the ones that fail."""

    # a replica that does not answer its load poll for this long is taken out
    # of the router and its requests migrate
    heartbeat_timeout_s: float = Field(2.0, gt=0, le=600)
    # a replica stalled this long, dead, or whose loop died is replaced
    replace_after_s: float = Field(10.0, gt=0, le=3600)
    restart_budget: int = Field(3, ge=0, le=1000)  # replacements per replica; past it the replica stays failed
    restart_backoff_s: float = Field(1.0, ge=0, le=600)  # before the n-th replacement: backoff * 2**(n-1)


class ProfileSpec(Strict):
    """A profiler window on every replica once the cluster serves: each writes
    a Chrome trace ``<dir>/<replica>-<time>.json`` on its own host (the paths
    are logged). For windows on demand, use the Profile RPC (`kvrelay profile`)."""

    dir: str = Field(min_length=1)
    seconds: float = Field(gt=0, le=600)
    # wait this long after startup (e.g. for a load generator to start)
    delay_s: float = Field(0.0, ge=0, le=MAX_SECONDS)
    with_stack: bool = False  # record Python stacks too (larger traces, slower)


class RaySpec(Strict):
    address: str | None = None  # None: join the cluster of `ray job submit`, else start a local one
    namespace: str = "kvrelay"


class Spec(Strict):
    # a checkpoint folder, a GGUF file, or the default model's name
    model: str = Field(DEFAULT_MODEL, min_length=1, max_length=4096)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    prefill: StageSpec = Field(default_factory=StageSpec)
    decode: StageSpec = Field(default_factory=StageSpec)
    colocated: StageSpec = Field(default_factory=StageSpec)
    transfer: TransferSpec = Field(default_factory=TransferSpec)
    router: RouterSpec = Field(default_factory=RouterSpec)
    health: HealthSpec = Field(default_factory=HealthSpec)
    frontend: FrontendSpec = Field(default_factory=FrontendSpec)
    auth: AuthSpec = Field(default_factory=AuthSpec)
    ray: RaySpec = Field(default_factory=RaySpec)
    network: NetworkSpec = Field(default_factory=NetworkSpec)
    profile: ProfileSpec | None = None  # None: no profile at startup

    @model_validator(mode="after")
    def _sections_match_mode(self) -> "Spec":
        problems = []
        unused = {"disaggregated": ["colocated"], "colocated": ["prefill", "decode"]}[self.mode]
        for name in unused:
            if name in self.model_fields_set:
                problems.append(f"{name}: section is not used in mode {self.mode!r}; remove it")
        if self.mode == "disaggregated" and self.decode.pipeline_parallel_size > 1:
            problems.append(f"decode.pipeline_parallel_size: {self.decode.pipeline_parallel_size} refused, "
                            f"{DECODE_PP_REASON}")
        if self.mode == "disaggregated" and self.prefill.block_size != self.decode.block_size:
            problems.append(f"decode.block_size: must equal prefill.block_size ({self.prefill.block_size}) "
                            f"so KV blocks transfer whole, got {self.decode.block_size}")
        problems += self.transfer.unused_options()
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def check_model(self, model_config) -> None:
        """The checks that need the model's config (`check_fits_model`: each stage's TP splits the heads, its
        pipeline_layer_split sums to the model's layers)."""
        check_fits_model(self.stages(), model_config)

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> "Spec":
        """pydantic's model_validate, raising SpecError (a ValueError) with every problem's path."""
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as e:
            raise SpecError(format_errors(e)) from None

    def stages(self) -> dict[Stage, StageSpec]:
        if self.mode == "colocated":
            return {Stage.COLOCATED: self.colocated}
        return {Stage.PREFILL: self.prefill, Stage.DECODE: self.decode}

    @classmethod
    def from_dict(cls, data: Any, source: str | None = None) -> "Spec":
        """Validate ``data``; raises SpecError listing every problem with its path."""
        try:
            return cls.model_validate({} if data is None else data)
        except SpecError as e:
            raise SpecError(e.problems, source) from None


def load_spec(path: str | os.PathLike) -> Spec:
    """Read and validate a YAML spec file; every problem (unreadable, not YAML, ...) is a SpecError naming it."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
    except OSError as e:
        raise SpecError([f"cannot read {path}: {e.strerror or e}"]) from None
    return parse_spec(raw, str(path))


def parse_spec(raw: bytes | str, source: str | None = None) -> Spec:
    """Validate a spec's YAML text (`cluster.spec_yaml.read_yaml`, then `Spec`)."""
    data = read_yaml(raw, source)
    if data is not None and not isinstance(data, dict):
        raise SpecError([f"(top level): must be a mapping, got {type(data).__name__}"], source)
    return Spec.from_dict(data, source)


def split_spec(spec: Spec) -> ClusterConfig:
    """Cut a validated spec into per-component configs, resolving secrets.

    Raises SpecError when an auth env var or file the spec names is missing.
    """
    stages = {}
    for stage, s in spec.stages().items():
        ray_options: dict[str, Any] = {"num_cpus": s.resources.num_cpus, "num_gpus": s.resources.num_gpus}
        if s.resources.custom:
            ray_options["resources"] = dict(s.resources.custom)
        stages[stage] = StageConfig(stage, s.replicas, s.tensor_parallel_size, ray_options,
                                    s.engine_config(spec.dtype), s.placement_strategy, s.placement_timeout_s,
                                    s.pipeline_parallel_size,
                                    tuple(s.pipeline_layer_split) if s.pipeline_layer_split else None)
    r = spec.router
    capacity = {stage: r.max_inflight_per_replica or s.max_num_seqs for stage, s in spec.stages().items()}
    router = RouterConfig(
        mode=spec.mode, policy=r.policy, max_queue=r.max_queue, queue_timeout_s=r.queue_timeout_s,
        max_inflight_per_replica=capacity, block_size=next(iter(spec.stages().values())).block_size,
        seed=r.seed,
    )
    transfer = spec.transfer.transfer_config(spec.auth.resolve_cluster_secret())
    f = spec.frontend
    frontend = FrontendConfig(
        host=f.host, grpc_port=f.grpc_port, http_port=f.http_port,
        tls_cert_file=f.tls.cert_file if f.tls else None, tls_key_file=f.tls.key_file if f.tls else None,
        api_keys=tuple(spec.auth.resolve_api_keys()), health_interval_s=f.health_interval_s,
        replicas=f.replicas, reuse_port=f.reuse_port and f.replicas > 1,
        tool_call_format=f.tool_call_format,
    )
    n = spec.network
    ports = lambda r: None if r is None else (r.first, r.last)  # noqa: E731
    network = NetworkConfig(n.host, ports(n.channel_ports), ports(n.kv_ports))
    p = spec.profile
    profile = ProfileConfig(p.dir, p.seconds, p.delay_s, p.with_stack) if p is not None else None
    h = spec.health
    health = HealthConfig(r.migration_limit, r.migration_max_tokens, h.heartbeat_timeout_s, h.replace_after_s,
                          h.restart_budget, h.restart_backoff_s)
    return ClusterConfig(spec.model, spec.dtype, spec.mode, stages, transfer, router, frontend,
                         spec.ray.address, spec.ray.namespace, profile, health=health, network=network)
