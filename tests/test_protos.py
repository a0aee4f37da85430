"""The committed gRPC stubs match the .proto files, and every rpc and field is documented."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from protos.generate import PROTOS, ROOT


def test_committed_stubs_are_up_to_date(tmp_path):
    # protoc runs in a process of its own: its bundled protobuf/abseil must not meet the native
    # libraries this test process loaded already (NIXL's, for one: protoc crashed beside them)
    subprocess.run([sys.executable, "-m", "protos.generate", str(tmp_path)], cwd=ROOT,
                   check=True, timeout=120)
    for proto in PROTOS:
        stem = proto.removesuffix(".proto")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            fresh = _unstamped((tmp_path / "protos" / f"{stem}{suffix}").read_text())
            committed = _unstamped((ROOT / "protos" / f"{stem}{suffix}").read_text())
            assert fresh == committed, f"protos/{stem}{suffix} is stale: python -m protos.generate"


def _unstamped(stub: str) -> str:
    """A stub without the grpcio-tools version that wrote it: the committed stubs keep the
    oldest grpcio they accept at run time (pyproject's floor), whatever tools generate them
    anew; only what the .proto files make of them must match."""
    return re.sub(r"^GRPC_GENERATED_VERSION = '[^']*'$", "GRPC_GENERATED_VERSION = ''", stub,
                  flags=re.M)


@pytest.mark.parametrize("proto", PROTOS)
def test_every_rpc_and_field_is_commented(proto):
    lines = Path(ROOT / "protos" / proto).read_text().splitlines()
    assert any(line.startswith("package pdserve.v1;") for line in lines)
    decl = re.compile(r"^\s*(rpc |(optional |repeated )?[\w.]+ \w+ = \d+;)")
    for i, line in enumerate(lines):
        if decl.match(line):
            commented = "//" in line or lines[i - 1].strip().startswith("//")
            assert commented, f"protos/{proto}:{i + 1} has no comment: {line.strip()}"
