"""Triton's example clients against Triton's example repository served by qkv: a fast subset of
`make triton-examples` (tests/triton_examples/run.py), one client of each kind of model."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.triton_examples.run import main

SUBSET = [
    "simple_grpc_infer_client",
    "simple_http_infer_client",
    "grpc_explicit_int_content_client",
    "simple_grpc_string_infer_client",
    "grpc_client",
    "image_client -i gRPC",
    "simple_grpc_sequence_sync_infer_client -d",
    "simple_grpc_health_metadata",
]


def test_tritons_example_clients_pass_against_tritons_example_repository(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["--out", str(tmp_path), "--only", *SUBSET])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert f"{len(SUBSET)} of {len(SUBSET)} clients passed" in printed, printed


def test_the_same_clients_pass_with_the_configs_in_tritons_json_form(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    subset = ["simple_grpc_infer_client", "grpc_client", "simple_grpc_sequence_sync_infer_client -d"]
    code = main(["--out", str(tmp_path), "--form", "json", "--only", *subset])
    printed = capsys.readouterr().out
    assert code == 0 and f"{len(subset)} of {len(subset)} clients passed" in printed, printed
    assert not list(tmp_path.glob("repository/*/config.pbtxt")) and list(tmp_path.glob("repository/*/config.json"))
