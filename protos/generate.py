"""Regenerate the Python modules of every .proto: protos/kvrelay/**/*.proto
(the serving API) and protos/*.proto (the KV transfer protocol).

    python protos/generate.py            # in place
    python protos/generate.py --out DIR  # elsewhere (the staleness test)

protoc is run with ``-I protos`` so the files keep their proto paths
(``kvrelay/v1/serving.proto``), then the generated imports are rewritten to
live under the ``protos`` package: ``from protos.kvrelay.v1 import serving_pb2``.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE = "protos"


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.glob("kvrelay/**/*.proto"))


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc
    import grpc_tools

    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    rel = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{well_known}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *rel]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    written = []
    for proto in rel:
        stem = out_dir / proto[: -len(".proto")]
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            path = Path(f"{stem}{suffix}")
            path.write_text(_fix_imports(path.read_text()))
            written.append(path)
    written += _generate_internal(out_dir)
    return written


def _generate_internal(out_dir: Path) -> list[Path]:
    """protos/*.proto keep the proto path `protos/x.proto` (imports `from protos import x_pb2`)."""
    import tempfile

    from grpc_tools import protoc

    written = []
    with tempfile.TemporaryDirectory() as tmp:
        for proto in sorted(PROTO_ROOT.glob("*.proto")):
            args = ["protoc", f"-I{PROTO_ROOT.parent}", f"--python_out={tmp}", f"--grpc_python_out={tmp}",
                    str(proto)]
            if protoc.main(args) != 0:
                raise RuntimeError(f"protoc failed: {' '.join(args)}")
        for src in sorted(Path(tmp, PACKAGE).glob("*.py")):
            dst = out_dir / src.name
            dst.write_text(src.read_text())
            written.append(dst)
    return written


def _fix_imports(src: str) -> str:
    # "from kvrelay.v1 import x_pb2 as ..." -> "from protos.kvrelay.v1 import x_pb2 as ..."
    return re.sub(r"^from kvrelay(\.[\w.]+)? import", lambda m: f"from {PACKAGE}.kvrelay{m.group(1) or ''} import",
                  src, flags=re.M)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=PROTO_ROOT, help="output root (default: protos/)")
    args = ap.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
