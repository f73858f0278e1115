"""Regenerate the Python code of protos/*.proto, or check that it is current.

    python -m protos.gen          # rewrite protos/*_pb2*.py
    python -m protos.gen --check  # exit 1 when the committed code is stale
"""
from __future__ import annotations

import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTOS = ("kvtransfer",)


def generate(out_dir: pathlib.Path) -> None:
    from grpc_tools import protoc

    for name in PROTOS:
        args = ["protoc", f"-I{ROOT}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}",
                str(ROOT / "protos" / f"{name}.proto")]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on protos/{name}.proto")


def stale_files() -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        generate(pathlib.Path(tmp))
        stale = []
        for path in sorted(pathlib.Path(tmp, "protos").glob("*.py")):
            committed = ROOT / "protos" / path.name
            if not committed.exists() or committed.read_text() != path.read_text():
                stale.append(f"protos/{path.name}")
        return stale


def main() -> int:
    if "--check" in sys.argv[1:]:
        stale = stale_files()
        if stale:
            print("stale generated code (run python -m protos.gen):", ", ".join(stale))
            return 1
        return 0
    generate(ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
