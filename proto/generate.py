"""Compile proto/**/*.proto into the descriptor set that service.protocol loads.

    .venv/bin/python proto/generate.py

We ship a binary FileDescriptorSet instead of generated ``_pb2`` modules: ``_pb2`` modules
register their messages in protobuf's process-wide default pool, where our ``inference.*``
names would collide with tritonclient's. The set is compiled without source info so the
output depends only on the .proto text (tests/protocol checks it is up to date).
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent
DESCRIPTOR_SET = PROTO_DIR.parent / "service" / "protocol" / "inference.binpb"


def compile_descriptor_set(out: Path = DESCRIPTOR_SET) -> Path:
    """Run protoc over every .proto in proto/ and write the descriptor set to ``out``."""
    # proto/xds/...: ORCA's load report, under the import paths its own files use.
    sources = sorted(path.relative_to(PROTO_DIR).as_posix() for path in PROTO_DIR.rglob("*.proto"))
    well_known = resources.files("grpc_tools") / "_proto"  # google/protobuf/duration.proto
    args = [
        "grpc_tools.protoc",
        f"--proto_path={PROTO_DIR}",
        f"--proto_path={well_known}",
        f"--descriptor_set_out={out}",
        "--include_imports",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return out


def main() -> int:
    print(compile_descriptor_set())
    return 0


if __name__ == "__main__":
    sys.exit(main())
