"""The transports sit below the endpoints: each imports without kvtransfer.receiver or kvtransfer.sender."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRANSPORTS = sorted(p.stem for p in (ROOT / "kvtransfer" / "transports").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("module", ["kvtransfer.transports", *(f"kvtransfer.transports.{m}" for m in TRANSPORTS)])
def test_a_transport_imported_first_imports_no_endpoint(module):
    code = (f"import sys, {module}; "
            "print(' '.join(m for m in ('kvtransfer.receiver', 'kvtransfer.sender') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing {module} imported {out.stdout.strip()}"


def test_the_transports_are_all_checked():
    assert {"base", "grpc_link", "local", "nccl_link", "service"} <= set(TRANSPORTS)
