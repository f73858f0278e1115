import pytest

from cluster.spec import SpecError, Spec, load_spec, split_spec
from cluster.types import Stage
from kvtransfer.config import GrpcLinkConfig, NcclLinkConfig, ReceiverConfig, SenderConfig


def problems(data) -> list[str]:
    with pytest.raises(SpecError) as info:
        Spec.model_validate(data)
    return info.value.problems


def test_empty_spec_is_the_local_default():
    spec = Spec.model_validate({})
    assert spec.model == "SmolLM2-135M-Instruct"
    assert spec.mode == "disaggregated"
    assert set(spec.stages()) == {Stage.PREFILL, Stage.DECODE}


def test_errors_carry_their_path():
    assert problems({"decode": {"replicas": 0}}) == ["decode.replicas: must be >= 1, got 0"]


def test_every_problem_is_reported_at_once():
    found = problems({
        "mode": "both",
        "decode": {"replicas": 0, "replica": 2},
        "router": {"policy": "random"},
        "prefill": {"block_size": 24, "num_kv_blocks": 8, "kv_cache_memory_gb": 1},
        "transfer": {"backend": "tcp", "options": {"lease_s": 0}},
    })
    assert "decode.replicas: must be >= 1, got 0" in found
    assert "decode.replica: unknown field" in found
    assert any(p.startswith("mode: must be one of") for p in found)
    assert any(p.startswith("router.policy: must be one of") for p in found)
    assert any(p.startswith("transfer.backend: must be one of") for p in found)
    assert "transfer.options.lease_s: must be > 0, got 0" in found
    assert "prefill.block_size: must be a power of two, got 24" in found
    assert len(found) == 7  # the both-cache-sizes check waits until block_size is valid


def test_cross_field_checks_name_the_field():
    assert problems({"prefill": {"num_kv_blocks": 8, "kv_cache_memory_gb": 1}}) == [
        "prefill: give num_kv_blocks or kv_cache_memory_gb, not both"]
    assert problems({"prefill": {"block_size": 32}}) == [
        "decode.block_size: must equal prefill.block_size (32) so KV blocks transfer whole, got 16"]
    assert problems({"mode": "colocated", "decode": {}}) == [
        "decode: section is not used in mode 'colocated'; remove it"]
    assert problems({"frontend": {"grpc_port": 9000, "http_port": 9000}}) == [
        "frontend: grpc_port and http_port must differ (both 9000)"]
    assert problems({"frontend": {"tls": {"cert_file": "c.pem"}}}) == [
        "frontend.tls.key_file: required field is missing"]


def test_load_spec_reports_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("decode:\n  replicas: 0\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(path) in str(info.value) and "decode.replicas: must be >= 1" in str(info.value)
    path.write_text("- a\n- b\n")
    with pytest.raises(SpecError, match="must be a mapping"):
        load_spec(path)
    path.write_text("decode: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(path)


def test_split_gives_each_component_its_config():
    spec = Spec.model_validate({
        "dtype": "bfloat16",
        "prefill": {"replicas": 2, "resources": {"num_gpus": 1, "custom": {"prefill_node": 1}},
                    "num_kv_blocks": 100},
        "decode": {"replicas": 3, "max_num_seqs": 8, "kv_cache_memory_gb": 2.5, "kv_cache_prefault": False},
        "router": {"policy": "prefix_aware"},
        "auth": {"api_keys": ["k1", "k2"]},
    })
    cfg = split_spec(spec)
    pre, dec = cfg.stages[Stage.PREFILL], cfg.stages[Stage.DECODE]
    assert (pre.num_replicas, dec.num_replicas) == (2, 3)
    assert pre.ray_options == {"num_cpus": 1.0, "num_gpus": 1.0, "resources": {"prefill_node": 1.0}}
    assert pre.engine.device == "cuda" and dec.engine.device == "cpu"
    assert pre.engine.num_kv_blocks == 100 and dec.engine.kv_cache_memory_gb == 2.5
    assert pre.engine.dtype == "bfloat16"
    assert pre.engine.kv_cache_prefault and not dec.engine.kv_cache_prefault  # served replicas: on by default
    assert cfg.router.policy == "prefix_aware"
    assert cfg.router.capacity(Stage.DECODE) == 8 and cfg.router.capacity(Stage.PREFILL) == 64
    assert cfg.frontend.api_keys == ("k1", "k2")
    assert cfg.transfer.sender.secret is None and cfg.transfer.receiver.secret is None
    pre.engine.validate()
    dec.engine.validate()



def test_each_stage_names_its_kernel_path():
    cfg = split_spec(Spec.model_validate({"prefill": {"kernel_isa": "none"}, "decode": {"kernel_isa": "avx2"}}))
    assert cfg.stages[Stage.PREFILL].engine.kernel_isa == "none"
    assert cfg.stages[Stage.DECODE].engine.kernel_isa == "avx2"
    assert split_spec(Spec.model_validate({})).stages[Stage.DECODE].engine.kernel_isa == "auto"
    assert any("decode.kernel_isa" in p for p in problems({"decode": {"kernel_isa": "avx1024"}}))


def test_transfer_defaults_are_the_transfer_services():
    transfer = split_spec(Spec.model_validate({})).transfer
    assert transfer.sender == SenderConfig() and transfer.receiver == ReceiverConfig()


def test_every_transfer_option_reaches_its_config():
    options = {"lease_s": 5, "deadline_s": 7, "checksum": True, "connect_timeout_s": 3, "chunk_timeout_s": 4,
               "max_chunk_bytes": 65536, "progress_timeout_s": 2, "max_workers": 8, "window": 6, "num_channels": 3,
               "stream_idle_s": 0.5}
    transfer = split_spec(Spec.model_validate({"transfer": {"backend": "grpc", "options": options}})).transfer
    assert transfer.sender == SenderConfig(lease_s=5, deadline_s=7, connect_timeout_s=3, chunk_timeout_s=4,
                                           max_chunk_bytes=65536, checksum=True, nccl=NcclLinkConfig(window=6),
                                           grpc=GrpcLinkConfig(window=6, num_channels=3, stream_idle_s=0.5))
    assert transfer.receiver == ReceiverConfig(transport="grpc", lease_s=5, progress_timeout_s=2, chunk_timeout_s=4,
                                               max_workers=8)
    filled = transfer.with_secret("s3cret")
    assert filled.sender.secret == filled.receiver.secret == "s3cret"
    assert filled.sender.grpc == transfer.sender.grpc


def test_a_transfer_option_is_known_bounded_and_used_by_the_backend():
    assert problems({"transfer": {"options": {"windw": 4}}}) == ["transfer.options.windw: unknown field"]
    assert problems({"transfer": {"options": {"window": 0, "stream_idle_s": 0}}}) == [
        "transfer.options.window: must be >= 1, got 0", "transfer.options.stream_idle_s: must be > 0, got 0"]
    assert problems({"transfer": {"backend": "nccl", "options": {"window": 8, "num_channels": 4}}}) == [
        "transfer.options.num_channels: only backend grpc uses it, not 'nccl'; remove it"]
    assert problems({"transfer": {"backend": "local", "options": {"window": 8}}}) == [
        "transfer.options.window: only backend grpc or nccl uses it, not 'local'; remove it"]

def test_colocated_split_has_one_stage():
    cfg = split_spec(Spec.model_validate({"mode": "colocated", "colocated": {"replicas": 2}}))
    assert list(cfg.stages) == [Stage.COLOCATED]
    assert cfg.stages[Stage.COLOCATED].num_replicas == 2


def test_profile_at_startup():
    assert split_spec(Spec.model_validate({})).profile is None
    config = split_spec(Spec.model_validate({"profile": {"dir": "/tmp/t", "seconds": 2}})).profile
    assert (config.out_dir, config.seconds, config.delay_s, config.with_stack) == ("/tmp/t", 2, 0, False)
    found = problems({"profile": {"dir": "", "seconds": 0, "every": 1}})
    assert "profile.seconds: must be > 0, got 0" in found and "profile.every: unknown field" in found
    assert any(p.startswith("profile.dir:") for p in found)
    assert problems({"profile": {"dir": "/tmp/t"}}) == ["profile.seconds: required field is missing"]


def test_secrets_resolve_from_env_and_file(tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("# clients\nalpha\n\nbeta\n")
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    auth = Spec.model_validate({"auth": {"api_keys_file": str(keys), "cluster_secret_file": str(secret)}}).auth
    assert auth.resolve_api_keys() == ["alpha", "beta"]
    assert auth.resolve_cluster_secret() == "s3cret"

    monkeypatch.setenv("KVR_TEST_KEYS", "a, b,")
    monkeypatch.delenv("KVR_TEST_SECRET", raising=False)
    auth = Spec.model_validate({"auth": {"api_keys_env": "KVR_TEST_KEYS", "cluster_secret_env": "KVR_TEST_SECRET"}}).auth
    assert auth.resolve_api_keys() == ["a", "b"]
    with pytest.raises(SpecError, match="auth.cluster_secret_env: environment variable KVR_TEST_SECRET is not set"):
        auth.resolve_cluster_secret()
    missing = Spec.model_validate({"auth": {"api_keys_file": str(tmp_path / "nope")}}).auth
    with pytest.raises(SpecError, match=r"auth.api_keys_file: cannot read .*nope"):
        missing.resolve_api_keys()


# ---- values no cluster can use, files that are not specs ------------------------
@pytest.mark.parametrize("data, problem", [
    ({"transfer": {"options": {"lease_s": float("inf")}}}, "transfer.options.lease_s: input should be a finite number"),
    ({"transfer": {"options": {"deadline_s": float("nan")}}}, "transfer.options.deadline_s: input should be a finite"),
    ({"router": {"queue_timeout_s": 1e308}}, "router.queue_timeout_s: must be <= 604800"),
    ({"decode": {"num_kv_blocks": 1e40}}, "decode.num_kv_blocks: input should be a valid integer"),
    ({"decode": {"num_kv_blocks": 10 ** 40}}, "decode.num_kv_blocks: must be <= 268435456"),
    ({"prefill": {"max_num_batched_tokens": 2 ** 63}}, "prefill.max_num_batched_tokens: must be <= 16777216"),
    ({"prefill": {"replicas": True}}, "prefill.replicas: input should be a valid integer"),
    ({"prefill": {"resources": {"custom": {"node:x": float("inf")}}}}, "prefill.resources.custom.node:x: input should"),
    ({"router": {"seed": -1}}, "router.seed: must be >= 0"),
    ({"network": {"kv_ports": {"first": 30010, "last": 30000}}}, "network.kv_ports: last (30000) must be >= first"),
    ({"network": {"channel_ports": {"first": 0, "last": 10}}}, "network.channel_ports.first: must be >= 1"),
])
def test_values_no_cluster_can_use_are_refused_with_their_path(data, problem):
    found = problems(data)
    assert len(found) == 1 and found[0].startswith(problem), found


def test_problems_quote_input_shortly_and_are_capped():
    found = problems({"model": "", "router": {"policy": "z" * 10_000}, "auth": {"api_keys": [[1]] * 500}})
    assert all(len(p) < 300 for p in found)
    assert found[-1].startswith("... and ") and len(found) <= 52


def write(tmp_path, raw: bytes):
    path = tmp_path / "spec.yaml"
    path.write_bytes(raw)
    return path


@pytest.mark.parametrize("raw, problem", [
    (b"model: caf\xe9\n", "(file): not UTF-8 text: byte 0xe9 at offset 10 (line 1)"),
    (b"a: " + b"[" * 600 + b"]" * 600 + b"\n", "(file): nested deeper than 32 levels at line 1"),
    (b"a:\n" + b"".join(b"  " * i + b"- \n" for i in range(1, 40)), "(file): nested deeper than 32 levels"),
    (b"router:\n  seed: " + b"9" * 6000 + b"\n", "not a usable YAML value: Exceeds the limit"),
    (b"decode:\n  num_kv_blocks: 1e40\n", "decode.num_kv_blocks: must be an integer, got the string '1e40'"),
    (b"router:\n  queue_timeout_s: 1.0e+308\n", "router.queue_timeout_s: must be <= 604800"),
    (b"transfer:\n  options:\n    lease_s: .inf\n", "transfer.options.lease_s: input should be a finite number"),
    (b"x" * (2 << 20), "(file): larger than"),
])
def test_a_file_that_is_no_spec_is_a_clear_error_naming_the_file(tmp_path, raw, problem):
    path = write(tmp_path, raw)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(path) in str(info.value)
    assert info.value.problems[0].startswith(problem), info.value.problems


def test_yaml_aliases_that_expand_a_small_file_are_refused_quickly(tmp_path):
    lines = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    path = write(tmp_path, ("\n".join(lines) + "\nauth:\n  api_keys: *a8\n").encode())
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert info.value.problems[0].startswith("auth.api_keys.0: input should be a valid string, got [[[[...]")
    assert all(len(p) < 300 for p in info.value.problems)


# ---- network -------------------------------------------------------------------
def test_network_defaults_loopback_locally_and_the_nodes_address_when_joined():
    config = split_spec(Spec.model_validate({}))
    assert config.frontend.host == "127.0.0.1"  # a spec opts in to 0.0.0.0
    net = config.network
    local, joined = (net.receiver_config(config.transfer.receiver, j) for j in (False, True))
    assert (local.host, local.port, local.port_max) == ("127.0.0.1", 0, None)
    assert (joined.host, joined.port, joined.port_max) == (None, 0, None)  # None: the receiver's node's address
    assert net.channel_bind(False, "10.0.0.5") == ("127.0.0.1", None, None)
    assert net.channel_bind(True, "10.0.0.5") == ("10.0.0.5", None, None)


def test_network_fields_reach_the_receiver_and_the_channel():
    config = split_spec(Spec.model_validate({
        "frontend": {"host": "0.0.0.0"},
        "network": {"host": "0.0.0.0", "channel_ports": {"first": 30000, "last": 30000},
                    "kv_ports": {"first": 30100, "last": 30131}}}))
    assert config.frontend.host == "0.0.0.0"
    receiver = config.network.receiver_config(config.transfer.receiver, True)
    assert (receiver.host, receiver.port, receiver.port_max) == ("0.0.0.0", 30100, 30131)
    assert config.network.channel_bind(True, "10.0.0.5") == ("0.0.0.0", "10.0.0.5", (30000, 30000))


def test_several_frontends_and_their_ports():
    fc = split_spec(Spec.model_validate({"frontend": {"replicas": 3}})).frontend
    assert (fc.replicas, fc.reuse_port) == (3, True)
    assert split_spec(Spec.model_validate({})).frontend.reuse_port is False  # one frontend shares nothing
    from cluster.frontend_replicas import frontend_ports
    assert frontend_ports(fc) == [(50051, 8000)] * 3
    own = split_spec(Spec.model_validate({"frontend": {"replicas": 3, "reuse_port": False}})).frontend
    assert frontend_ports(own) == [(50051, 8000), (50052, 8001), (50053, 8002)]
    with pytest.raises(SpecError, match="frontend.*overlap"):
        Spec.model_validate({"frontend": {"replicas": 3, "reuse_port": False, "grpc_port": 8000,
                                          "http_port": 8002}})
    with pytest.raises(SpecError, match="frontend.*65535"):
        Spec.model_validate({"frontend": {"replicas": 4, "reuse_port": False, "grpc_port": 65534}})
    with pytest.raises(SpecError, match="frontend.replicas"):
        Spec.model_validate({"frontend": {"replicas": 0}})
