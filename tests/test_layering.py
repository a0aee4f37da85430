"""The architecture's import rules (DESIGN.md, STYLE.md), checked rather than hoped for."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NETWORK = ("grpc", "grpc_health", "fastapi", "uvicorn", "starlette", "redis", "protos")
SERVICES = ("gateway", "tokenizer_svc", "prefill_svc", "decode_svc", "pdserve")


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("path", sorted((ROOT / "engine").rglob("*.py")), ids=str)
def test_engine_imports_no_network_code_and_no_service(path):
    bad = imported_roots(path) & set(NETWORK + SERVICES)
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize(
    "module", ["engine.scheduler", "engine.scheduler_output", "engine.block_manager",
               "engine.request", "engine.config", "engine.sampling_params", "engine.detokenizer",
               "engine.stop_checker"],
)
def test_policy_modules_do_not_load_torch(module):
    code = f"import sys, {module}; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_only_the_state_modules_import_redis():
    """The Redis stores of pdserve.cluster, every key from `state.Keys`: state (the key schema,
    request state), cancel_listener (its pub/sub channel), registry (workers), event_log and
    log_writer (resumable streams' events, and a gateway's writes of them), prefix_index (the
    workers' cached prefix blocks), response_store (stored Responses API responses)."""
    users = {
        str(p.relative_to(ROOT))
        for p in ROOT.rglob("*.py")
        if "tests" not in p.parts and "redis" in imported_roots(p)
    }
    assert users == {"pdserve/cluster/state.py", "pdserve/cluster/cancel_listener.py",
                     "pdserve/cluster/registry.py", "pdserve/cluster/event_log.py",
                     "pdserve/cluster/log_writer.py", "pdserve/cluster/prefix_index.py",
                     "pdserve/cluster/response_store.py"}


def test_protobuf_stays_at_the_service_edge():
    for p in (ROOT / "engine").rglob("*.py"):
        assert "_pb2" not in p.read_text(), p
