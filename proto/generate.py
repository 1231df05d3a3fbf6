"""Regenerate the gRPC stubs in pagedserve/wire/v1/ from proto/pagedserve/wire/v1/*.proto.

Run from anywhere: `python proto/generate.py` (or pass an output root, for the staleness
test). The stubs are committed; tests/unit/wire/test_proto_stubs.py fails when they are stale.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PACKAGE = Path("pagedserve", "wire") / "v1"


def proto_files() -> list[str]:
    return sorted(str(p.relative_to(PROTO_DIR)) for p in (PROTO_DIR / PACKAGE).glob("*.proto"))


def generate(out_root: Path = ROOT) -> list[Path]:
    """Write pagedserve/wire/v1/*_pb2.py and *_pb2_grpc.py under out_root; return their paths."""
    import grpc_tools
    from grpc_tools import protoc

    out_root = Path(out_root)
    (out_root / PACKAGE).mkdir(parents=True, exist_ok=True)
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = ["grpc_tools.protoc", f"-I{PROTO_DIR}", f"-I{include}",
            f"--python_out={out_root}", f"--grpc_python_out={out_root}", *proto_files()]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    init = out_root / PACKAGE / "__init__.py"
    if not init.exists():
        init.write_text('"""Generated gRPC stubs of the pagedserve.v1 protocol (python proto/generate.py)."""\n')
    return sorted((out_root / PACKAGE).glob("*_pb2*.py"))


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    for path in generate(out):
        print(path)
