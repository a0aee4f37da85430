"""Regenerate the Python stubs from the .proto files: `python -m protos.generate`.

The stubs are committed; `tests/test_protos.py` fails when they drift from the .proto files.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTOS = ("common.proto", "tokenizer.proto", "prefill.proto", "decode.proto")
ROOT = Path(__file__).resolve().parent.parent


def generate(out_dir: Path = ROOT) -> None:
    """Write *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every proto under `out_dir/protos`."""
    from grpc_tools import protoc

    (out_dir / "protos").mkdir(parents=True, exist_ok=True)
    args = [
        "protoc", f"-I{ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}", *(f"protos/{p}" for p in PROTOS),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
