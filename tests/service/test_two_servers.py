"""Two servers in one process: each keeps its own state (models, compute threads and their priority, the data
plane its ensembles step through, its ports), so both answer, and one stopping leaves the other answering."""

from __future__ import annotations

import asyncio
import importlib.util
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from service.config import ServerSettings
from service.errors import ConfigError
from service.server import Server
from service.serving.dataplane_types import InferInput, InferRequest, InferResponse
from tests.conftest import MODELS

MODEL = "g2p_encoder"
IDS = np.array([[5, 6, 7, 8, 9]], dtype=np.int64)


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    shutil.copytree(MODELS / MODEL, root / MODEL)
    return root


def _settings(repository: Path, nice: int = 0, grpc_port: int = 0) -> ServerSettings:
    return ServerSettings(
        model_repository=repository,
        host="127.0.0.1",
        grpc_port=grpc_port,
        http_port=0,
        metrics_port=-1,
        compute_nice=nice,
    )


def _tensors(module: Any, binary: bool) -> list[Any]:
    inputs = []
    for name, array in (("input_ids", IDS), ("attention_mask", np.ones_like(IDS))):
        t = module.InferInput(name, list(array.shape), "INT64")
        if binary:
            t.set_data_from_numpy(array)
        else:
            t.set_data_from_numpy(array, binary_data=False)
        inputs.append(t)
    return inputs


def _over(module: Any, binary: bool, port: int) -> np.ndarray:
    """The answer through a tritonclient (grpc or http) to the server on `port`."""
    client = module.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        return client.infer(MODEL, _tensors(module, binary)).as_numpy("last_hidden_state")
    finally:
        client.close()


_over_grpc = partial(_over, grpcclient, True)
_over_http = partial(_over, httpclient, False)  # JSON tensors: REST's own decoding


async def _direct(server: Server) -> np.ndarray:
    inputs = [InferInput.of("input_ids", IDS), InferInput.of("attention_mask", np.ones_like(IDS))]
    answer = await server.plane.infer(InferRequest(MODEL, inputs=inputs))
    assert isinstance(answer, InferResponse), answer
    return answer.outputs["last_hidden_state"]


def _refused(call: Callable[[], object]) -> bool:
    try:
        call()
    except (InferenceServerException, OSError):  # refused by the server, or no one listens
        return True
    return False


def test_two_servers_in_one_process_answer_apart_and_one_outlives_the_other(repository: Path) -> None:
    async def main() -> None:
        first, second = Server(_settings(repository)), Server(_settings(repository, nice=3))
        await first.start()
        await second.start()
        try:
            # Each server holds its own state: its compute threads' priority, the slots (cores) its models'
            # threads took, the data plane its ensembles run their steps on.
            assert (first.compute.nice, second.compute.nice) == (0, 3)
            [one] = first.registry.served()
            [other] = second.registry.served()
            instances = len(one.runtime.sessions)  # type: ignore[attr-defined]
            assert first.compute.slots == second.compute.slots == instances  # not counted across servers
            assert first.registry.steps is first.plane and second.registry.steps is second.plane
            assert other.batcher.compute is second.compute  # type: ignore[attr-defined]
            assert len({first.grpc_port, second.grpc_port, first.http_port, second.http_port}) == 4

            expected = await _direct(first)
            for server in (first, second):
                np.testing.assert_allclose(await _direct(server), expected, rtol=1e-5, atol=1e-6)
                for call, port in ((_over_grpc, server.grpc_port), (_over_http, server.http_port)):
                    answer = await asyncio.to_thread(call, port)
                    np.testing.assert_allclose(answer, expected, rtol=1e-5, atol=1e-6)

            await first.drain()
            assert await asyncio.to_thread(_refused, lambda: _over_grpc(first.grpc_port))
            assert await asyncio.to_thread(_refused, lambda: _over_http(first.http_port))
            # The other server keeps its models and its ports.
            np.testing.assert_allclose(await asyncio.to_thread(_over_grpc, second.grpc_port), expected, rtol=1e-5)
            np.testing.assert_allclose(await asyncio.to_thread(_over_http, second.http_port), expected, rtol=1e-5)
            np.testing.assert_allclose(await _direct(second), expected, rtol=1e-5, atol=1e-6)
            [version] = second.plane.statistics(MODEL)
            assert version.stats.success_count == 6 and version.stats.fail_count == 0
        finally:
            await first.drain()
            await second.drain()

    asyncio.run(main())


def test_servers_that_ask_for_it_share_one_grpc_port(repository: Path) -> None:
    """`reuse_port`: N workers behind one port (SO_REUSEPORT); each answers what reaches it."""

    async def main() -> None:
        first = Server(_settings(repository), reuse_port=True)
        await first.start()
        second = Server(_settings(repository, grpc_port=first.grpc_port), reuse_port=True)
        try:
            await second.start()
            assert second.grpc_port == first.grpc_port
            expected = await _direct(first)
            await first.drain()  # what connects now reaches the other
            np.testing.assert_allclose(await asyncio.to_thread(_over_grpc, second.grpc_port), expected, rtol=1e-5)
        finally:
            await first.drain()
            await second.drain()

    asyncio.run(main())


@pytest.mark.skipif(importlib.util.find_spec("uvloop") is None, reason="uvloop is not installed")
def test_a_server_runs_on_uvloop(repository: Path) -> None:
    """Nothing of a server needs asyncio's own loop: on uvloop it loads and answers (its batcher, knowing
    no idle waits there, takes no request for one that waited behind another)."""
    import uvloop

    async def main() -> None:
        server = Server(_settings(repository))
        await server.start()
        try:
            first = await _direct(server)
            np.testing.assert_allclose(await asyncio.to_thread(_over_grpc, server.grpc_port), first, rtol=1e-5)
            np.testing.assert_allclose(await asyncio.to_thread(_over_http, server.http_port), first, rtol=1e-5)
        finally:
            await server.drain()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())


def test_a_grpc_port_another_server_holds_is_refused_without_reuse_port(repository: Path) -> None:
    async def main() -> None:
        first = Server(_settings(repository))
        await first.start()
        try:
            second = Server(_settings(repository, grpc_port=first.grpc_port))
            with pytest.raises(ConfigError, match=f"cannot bind the gRPC port 127.0.0.1:{first.grpc_port}") as e:
                await second.start()
            assert e.value.key == "--grpc-port"
            await second.drain()
            answer = await asyncio.to_thread(_over_grpc, first.grpc_port)
            np.testing.assert_allclose(answer, await _direct(first), rtol=1e-5, atol=1e-6)
        finally:
            await first.drain()

    asyncio.run(main())
