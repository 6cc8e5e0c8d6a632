"""The committed service/protocol/_messages.pyi is what proto/stubs.py writes from the descriptor set, and it
describes the classes service.protocol builds at run time."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from service import protocol
from tests.conftest import script_module

ROOT = Path(__file__).resolve().parents[2]


def _stubs_module() -> ModuleType:
    return script_module(ROOT / "proto" / "stubs.py", "proto_stubs")


def test_committed_stubs_are_up_to_date() -> None:
    stubs = _stubs_module()
    data = (ROOT / "service" / "protocol" / "inference.binpb").read_bytes()
    assert stubs.STUBS.read_text() == stubs.stubs(data), "stale stubs: run .venv/bin/python proto/stubs.py"


def test_stubs_name_every_class_the_protocol_exports_with_its_fields() -> None:
    text = (ROOT / "service" / "protocol" / "_messages.pyi").read_text()
    exported = [
        n
        for n in protocol.__all__
        if n != "Message" and isinstance(getattr(protocol, n), type) and hasattr(getattr(protocol, n), "DESCRIPTOR")
    ]
    assert "ModelInferRequest" in exported
    for name in exported:
        cls = getattr(protocol, name)
        assert f"\nclass {name}(_Message):" in text, name
        block = text.split(f"\nclass {name}(_Message):", 1)[1].split("\nclass ", 1)[0]
        for field in cls.DESCRIPTOR.fields:
            if field.name != "global":
                assert f" {field.name}" in block, f"{name}.{field.name}"
