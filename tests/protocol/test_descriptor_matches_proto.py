"""The committed service/protocol/inference.binpb is what proto/*.proto compiles to."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from google.protobuf import descriptor_pb2

from tests.conftest import script_module

ROOT = Path(__file__).resolve().parents[2]


def _generate_module() -> ModuleType:
    # proto/ is not a package: load the script itself, so the test compiles exactly as it does.
    return script_module(ROOT / "proto" / "generate.py", "proto_generate")


def _read_set(path: Path) -> descriptor_pb2.FileDescriptorSet:
    return descriptor_pb2.FileDescriptorSet.FromString(path.read_bytes())


def test_committed_descriptor_set_is_up_to_date(tmp_path: Path) -> None:
    generate = _generate_module()
    fresh = generate.compile_descriptor_set(tmp_path / "inference.binpb")
    committed = ROOT / "service" / "protocol" / "inference.binpb"
    assert committed == generate.DESCRIPTOR_SET
    assert _read_set(fresh) == _read_set(committed), "stale descriptor set: run .venv/bin/python proto/generate.py"


def test_descriptor_set_holds_only_our_files_without_source_info() -> None:
    files = _read_set(ROOT / "service" / "protocol" / "inference.binpb").file
    packages = {file.name: file.package for file in files}
    assert packages == {
        "model_config.proto": "inference",
        "grpc_service.proto": "inference",
        "xds/data/orca/v3/orca_load_report.proto": "xds.data.orca.v3",  # ORCA, vendored
        "xds/service/orca/v3/orca.proto": "xds.service.orca.v3",
        "google/protobuf/duration.proto": "google.protobuf",  # ORCA's import
    }
    assert not any(file.HasField("source_code_info") for file in files)
