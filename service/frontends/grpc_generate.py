"""ModelStreamInfer for a generating model: decoupled, one response a chunk (docs/generation.md,
"Interfaces").

A request holds `text_input` (BYTES [1]) and, as the inputs of Triton's vLLM backend, optional `stream`,
`exclude_input_in_output`, `return_finish_reason`, `return_num_input_tokens`, `return_num_output_tokens`
(BOOL [1]) and `sampling_parameters` (BYTES [1], a JSON object); `ignore_eos` (BOOL [1]) and `max_tokens`,
`temperature`, `top_p`, `top_k`, `seed`, `repetition_penalty` (a number [1]) may come as inputs too, as
TensorRT-LLM's clients send them; its parameters carry the sampling fields as well (a list, such as stop,
as a JSON string). With stream true each chunk
is a response of its own, with stream false (the default) the whole text is one; either way the last
response of a request carries the parameter `triton_final_response` true, the others false, as Triton
flags a decoupled model's responses, so that tritonclient's `async_stream_infer` (with
`enable_empty_final_response=True`) sees where each request's answer ends.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Awaitable, Callable
from typing import Any

from service import protocol
from service.datatypes import InputLimits
from service.errors import Internal, InvalidArgument, quote
from service.frontends.generation import chunks
from service.frontends.triton_generation import EXTRAS, Generation, stream_fields, triton_generation
from service.serving.dataplane import DataPlane
from service.serving.dataplane_types import InferRequest

__all__ = ["stream_generation"]

BOOL_INPUTS = ("stream", "exclude_input_in_output", "ignore_eos", *EXTRAS)
# Sampling fields a client may send as one-element number tensors, as TensorRT-LLM's clients send max_tokens.
NUMBER_INPUTS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "repetition_penalty")
TEXT_BYTES = 1 << 22  # text_input and sampling_parameters, at most (within --max-message-bytes anyway)
# A response, and whether it is its request's last
Put = Callable[[protocol.ModelStreamInferResponse, bool], Awaitable[None]]


def _inputs(request: InferRequest) -> tuple[str, str | None, dict[str, Any]]:
    """(text_input, sampling_parameters, the BOOL and number inputs set) of a stream request, each checked."""
    text, sampling = None, None
    flags: dict[str, Any] = {}
    for tensor in request.inputs:
        if tensor.name in ("text_input", "sampling_parameters"):
            array = tensor.read(InputLimits(elements=1, element_bytes=TEXT_BYTES, why="one text"))
            if tensor.datatype != "BYTES" or array.size != 1:
                raise InvalidArgument(f"input {quote(tensor.name)} must be BYTES holding one element")
            try:
                value = bytes(array.reshape(-1)[0]).decode()
            except UnicodeDecodeError:
                raise InvalidArgument(f"input {quote(tensor.name)} is not UTF-8") from None
            if tensor.name == "text_input":
                text = value
            else:
                sampling = value
        elif tensor.name in BOOL_INPUTS:
            array = tensor.read(InputLimits(elements=1, why="one flag"))
            if tensor.datatype != "BOOL" or array.size != 1:
                raise InvalidArgument(f"input {quote(tensor.name)} must be BOOL holding one element")
            flags[tensor.name] = bool(array.reshape(-1)[0])
        elif tensor.name in NUMBER_INPUTS:
            array = tensor.read(InputLimits(elements=1, why="one number"))
            if array.dtype.kind not in "iuf" or array.size != 1:
                raise InvalidArgument(f"input {quote(tensor.name)} must be a number tensor holding one element")
            flags[tensor.name] = array.reshape(-1)[0].item()
        else:
            raise InvalidArgument(
                f"input {quote(tensor.name)}: a generating model takes text_input, sampling_parameters, "
                f"{', '.join(BOOL_INPUTS)} and {', '.join(NUMBER_INPUTS)}"
            )
    if text is None:
        raise InvalidArgument("input 'text_input' is required: the prompt, BYTES [1]")
    return text, sampling, flags


def _response(
    request: InferRequest, g: Generation, fields: dict[str, Any], final: bool
) -> protocol.ModelStreamInferResponse:
    response = protocol.ModelInferResponse(model_name=g.model.name, model_version=g.model.version, id=request.id)
    for name, value in fields.items():
        if name == "text_output" or name == "finish_reason":
            data = str(value).encode()
            response.outputs.add(name=name, datatype="BYTES", shape=[1])
            response.raw_output_contents.append(struct.pack("<I", len(data)) + data)  # one BYTES element
        else:
            response.outputs.add(name=name, datatype="UINT32", shape=[1])
            response.raw_output_contents.append(struct.pack("<I", value))
    response.parameters["triton_final_response"].bool_param = final
    return protocol.ModelStreamInferResponse(infer_response=response)


async def stream_generation(plane: DataPlane, request: InferRequest, put: Put) -> None:
    """Answer one stream request of a generating model through `put`; a ServingError raised before the first
    response is the request's error response (the caller's), one after it ends the request's responses."""
    text, sampling, flags = _inputs(request)
    fields = stream_fields(request.parameters, sampling) | flags
    stream = bool(flags.get("stream", fields.get("stream", False)))
    g = triton_generation(plane, request.model_name, request.model_version, text, fields, stream, request.deadline)
    said: list[str] = []
    async with contextlib.aclosing(chunks(plane, g.model, g.request)) as answer:
        async for chunk in answer:
            final = chunk.finish_reason is not None
            if stream:
                if chunk.text or final:
                    await put(_response(request, g, g.fields(chunk, chunk.text), final), final)
            else:
                said.append(chunk.text)
                if final:
                    output = (g.prompt if g.prepend else "") + "".join(said)
                    await put(_response(request, g, g.fields(chunk, output), True), True)
            if final:
                return
    raise Internal("the model's answer ended without a finish reason")
