"""The typed transfer configs: defaults as the endpoints had them, bad values named, the secret kept out of logs."""
import dataclasses
import pickle

import pytest

from kvtransfer.config import GrpcLinkConfig, NcclLinkConfig, ReceiverConfig, SenderConfig


def test_defaults():
    sender = SenderConfig("s")
    assert (sender.lease_s, sender.deadline_s, sender.connect_timeout_s, sender.chunk_timeout_s) == (30, 60, 10, 30)
    assert sender.max_chunk_bytes == 4 << 20 and not sender.checksum
    assert sender.grpc == GrpcLinkConfig(window=16, num_channels=2, stream_idle_s=2.0)
    assert sender.nccl == NcclLinkConfig(window=32)
    receiver = ReceiverConfig("s")
    assert (receiver.transport, receiver.host, receiver.port, receiver.advertise_host) == ("grpc", "127.0.0.1", 0, None)
    assert (receiver.lease_s, receiver.progress_timeout_s, receiver.chunk_timeout_s, receiver.max_workers) \
        == (30, 10, 30, 256)


@pytest.mark.parametrize("make, field", [
    (lambda: SenderConfig("s", deadline_s=-1), "SenderConfig.deadline_s: must be >= 0"),
    (lambda: SenderConfig("s", chunk_timeout_s=0), "SenderConfig.chunk_timeout_s: must be > 0"),
    (lambda: SenderConfig("s", max_chunk_bytes=0), "SenderConfig.max_chunk_bytes: must be in"),
    (lambda: SenderConfig("s", max_chunk_bytes=1.5), "SenderConfig.max_chunk_bytes: must be an int"),
    (lambda: SenderConfig("s", checksum="yes"), "SenderConfig.checksum: must be a bool"),
    (lambda: SenderConfig(""), "SenderConfig.secret: must not be empty"),
    (lambda: SenderConfig("s", grpc={"window": 4}), "SenderConfig.grpc: must be a GrpcLinkConfig"),
    (lambda: GrpcLinkConfig(window=0), "GrpcLinkConfig.window: must be >= 1"),
    (lambda: GrpcLinkConfig(stream_idle_s=float("nan")), "GrpcLinkConfig.stream_idle_s: must be > 0"),
    (lambda: NcclLinkConfig(window=True), "NcclLinkConfig.window: must be an int"),
    (lambda: ReceiverConfig("s", "tcp"), "ReceiverConfig.transport: must be one of"),
    (lambda: ReceiverConfig("s", port=70000), "ReceiverConfig.port: must be in [0, 65535]"),
    (lambda: ReceiverConfig("s", max_workers=0), "ReceiverConfig.max_workers: must be >= 1"),
    (lambda: ReceiverConfig("s", progress_timeout_s=0), "ReceiverConfig.progress_timeout_s: must be > 0"),
])
def test_a_bad_value_is_refused_with_its_field(make, field):
    with pytest.raises(ValueError) as info:
        make()
    assert str(info.value).startswith(field), str(info.value)


def test_an_unknown_option_is_an_error():
    with pytest.raises(TypeError, match="windw"):
        SenderConfig("s", windw=4)


def test_the_secret_is_filled_in_later_and_never_printed():
    config = SenderConfig(lease_s=5)
    assert config.secret is None
    filled = dataclasses.replace(config, secret="hunter2")
    assert filled.secret == "hunter2" and filled.lease_s == 5
    assert "hunter2" not in repr(filled) and "hunter2" not in repr(ReceiverConfig("hunter2"))
    assert pickle.loads(pickle.dumps(filled)) == filled  # Ray ships it to the replicas
