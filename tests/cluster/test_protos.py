import filecmp
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_up_to_date(tmp_path):
    """Fails when a .proto changed without `python protos/generate.py`."""
    subprocess.run([sys.executable, str(ROOT / "protos" / "generate.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True)
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert fresh, "protoc wrote nothing"
    for rel in fresh:
        committed = ROOT / "protos" / rel
        assert committed.exists(), f"protos/{rel} is not committed; run python protos/generate.py"
        assert filecmp.cmp(tmp_path / rel, committed, shallow=False), \
            f"protos/{rel} is stale; run python protos/generate.py"


def test_generated_modules_import_as_a_package():
    from protos.kvrelay.v1 import serving_pb2, serving_pb2_grpc

    assert serving_pb2.DESCRIPTOR.package == "kvrelay.v1"
    assert hasattr(serving_pb2_grpc, "KVRelayStub")
    req = serving_pb2.GenerateRequest(text="hi", sampling=serving_pb2.SamplingParams(max_tokens=3))
    assert req.WhichOneof("prompt") == "text" and req.sampling.HasField("max_tokens")
    assert not req.sampling.HasField("temperature")
