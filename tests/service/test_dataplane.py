"""The data plane used in the process, on the shipped g2p_encoder: the same answers, refusals and counts as
through gRPC and REST, and both front ends reach it through the one `DataPlane.infer`."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from service.config import ServerSettings
from service.errors import InvalidArgument, NotFound, ServingError
from service.server import Server
from service.serving.dataplane import DataPlane
from service.serving.dataplane_types import InferInput, InferRequest, InferResponse
from tests.conftest import MODELS

MODEL = "g2p_encoder"


def _inputs(ids: np.ndarray) -> list[InferInput]:
    return [InferInput.of("input_ids", ids), InferInput.of("attention_mask", np.ones_like(ids))]


def _grpc(url: str, ids: np.ndarray) -> np.ndarray:
    client = grpcclient.InferenceServerClient(url)
    inputs = []
    for name, array in (("input_ids", ids), ("attention_mask", np.ones_like(ids))):
        t = grpcclient.InferInput(name, list(array.shape), "INT64")
        t.set_data_from_numpy(array)
        inputs.append(t)
    try:
        return client.infer(MODEL, inputs, request_id="grpc").as_numpy("last_hidden_state")
    finally:
        client.close()


def _http(url: str, ids: np.ndarray) -> np.ndarray:
    client = httpclient.InferenceServerClient(url)
    inputs = []
    for name, array in (("input_ids", ids), ("attention_mask", np.ones_like(ids))):
        t = httpclient.InferInput(name, list(array.shape), "INT64")
        t.set_data_from_numpy(array, binary_data=False)  # JSON data: REST's own decoding, not raw bytes
        inputs.append(t)
    try:
        return client.infer(MODEL, inputs, request_id="http").as_numpy("last_hidden_state")
    finally:
        client.close()


def _refusal(call: Any) -> str:
    with pytest.raises(InferenceServerException) as e:
        call()
    return str(e.value.message())


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    shutil.copytree(MODELS / MODEL, root / MODEL)
    return root


def _settings(repository: Path) -> ServerSettings:
    return ServerSettings(model_repository=str(repository), host="127.0.0.1", grpc_port=0, http_port=0, metrics_port=-1)


def test_grpc_rest_and_a_direct_call_get_the_same_answer_through_the_one_infer(repository: Path) -> None:
    ids = np.random.default_rng(7).integers(4, 33, size=(1, 12), dtype=np.int64)

    async def main() -> None:
        server = Server(_settings(repository))
        await server.start()
        plane = server.plane
        seen: list[tuple[str, str]] = []
        through = plane.infer

        async def recorded(request: InferRequest) -> InferResponse | ServingError:
            seen.append((request.method, request.id))
            return await through(request)

        plane.infer = recorded  # type: ignore[method-assign]  # records, and answers as the data plane does
        try:
            direct = await plane.infer(InferRequest(MODEL, id="direct", inputs=_inputs(ids)))
            assert isinstance(direct, InferResponse) and (direct.model_name, direct.model_version) == (MODEL, "1")
            over_grpc = await asyncio.to_thread(_grpc, f"127.0.0.1:{server.grpc_port}", ids)
            over_http = await asyncio.to_thread(_http, f"127.0.0.1:{server.http_port}", ids)
            hidden = direct.outputs["last_hidden_state"]
            assert hidden.shape == (1, 12, 192) and hidden.dtype == np.float32
            np.testing.assert_allclose(over_grpc, hidden, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(over_http, hidden, rtol=1e-5, atol=1e-6)
            assert seen == [("ModelInfer", "direct"), ("ModelInfer", "grpc"), ("POST /v2/models/{model}/infer", "http")]
            [version] = plane.statistics(MODEL)
            assert version.stats.success_count == 3 and version.stats.fail_count == 0
            assert server.metrics.requests.labels(MODEL, "1", "OK")._value.get() == 3
        finally:
            await server.drain()

    asyncio.run(main())


def test_a_bad_request_is_refused_with_one_message_whichever_way_it_comes(repository: Path) -> None:
    bad = np.array([[5, 99, 6]], dtype=np.int64)  # 99: outside g2p_encoder's vocabulary of 33

    async def main() -> None:
        server = Server(_settings(repository))
        await server.start()
        plane = server.plane
        try:
            direct = await plane.infer(InferRequest(MODEL, inputs=_inputs(bad)))
            assert isinstance(direct, InvalidArgument)
            assert direct.message == "input 'input_ids': token id 99 outside the vocabulary [0, 33)"
            grpc_url, http_url = f"127.0.0.1:{server.grpc_port}", f"127.0.0.1:{server.http_port}"
            assert await asyncio.to_thread(_refusal, lambda: _grpc(grpc_url, bad)) == direct.message
            assert await asyncio.to_thread(_refusal, lambda: _http(http_url, bad)) == direct.message
            unknown = await plane.infer(InferRequest("nope", inputs=_inputs(bad)))
            assert isinstance(unknown, NotFound) and "Request for unknown model: 'nope' is not found" in unknown.message
            [version] = plane.statistics(MODEL)
            assert version.stats.fail_count == 3 and version.stats.success_count == 0
            assert server.metrics.requests.labels(MODEL, "1", "INVALID_ARGUMENT")._value.get() == 3
            assert server.metrics.requests.labels("unknown", "", "NOT_FOUND")._value.get() == 1
        finally:
            await server.drain()

    asyncio.run(main())


def test_an_array_is_checked_against_what_its_input_declares(repository: Path) -> None:
    """An in-process caller's input says its datatype and shape, as a wire's does: an array that is
    otherwise, or a shape over the model's limits, is refused naming the input, before the model runs."""
    ids = np.ones((1, 4), dtype=np.int64)

    async def main() -> None:
        server = Server(_settings(repository))
        await server.start()
        plane: DataPlane = server.plane
        try:
            mask = InferInput.of("attention_mask", ids)
            lying = InferInput("input_ids", "INT64", (1, 5), InferInput.of("input_ids", ids).source)
            refused = await plane.infer(InferRequest(MODEL, inputs=[lying, mask]))
            assert isinstance(refused, InvalidArgument)
            assert refused.message == "input 'input_ids': an array of INT64 [1, 4], declared INT64 [1, 5]"
            twice = await plane.infer(InferRequest(MODEL, inputs=[mask, mask]))
            assert isinstance(twice, InvalidArgument) and twice.message == "input 'attention_mask' given twice"
            assert plane.model(MODEL).stats.fail_count == 2
        finally:
            await server.drain()

    asyncio.run(main())
