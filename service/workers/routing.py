"""A worker's data plane and shared memory regions: the state a client expects to be global made so.

- Model load and unload go to the supervisor, which applies them on every worker (this one included) and
  answers once all have; an error names the worker it came from.
- A system shared memory region registered or unregistered here is registered or unregistered on every other
  worker before the call is answered.
- A sequence's requests go to the worker that holds its state: its sequence id, hashed, names the worker
  (`owner`); a request that reaches another worker is forwarded there over the channel, its inputs read here.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from service.errors import ServingError, Unavailable, quote
from service.frontends.shared_memory import SharedMemoryRegistry
from service.models.catalog import ServedVersion, input_limits
from service.models.common import ModelStats
from service.serving.dataplane import DataPlane
from service.serving.dataplane_types import InferInput, InferRequest, InferResponse, Parameter, RequestedOutput
from service.workers.channel import ChannelError, Peer
from service.workers.statistics import PEER_TIMEOUT_S, Counts, summed

__all__ = ["WorkerLink", "WorkerPlane", "WorkerRegions", "owner"]


def owner(sequence_id: Parameter, count: int) -> int:
    """The worker (0..count-1) that holds sequence `sequence_id`'s state."""
    return zlib.crc32(str(sequence_id).encode()) % count


@dataclass
class WorkerLink:
    """One worker's place among its peers: its index, the supervisor, and every worker's channel end."""

    index: int
    count: int
    supervisor: Peer
    workers: list[Peer] = field(default_factory=list)

    async def everywhere(self, message: tuple[Any, ...]) -> Any:
        """`message` applied by the supervisor on every worker; Unavailable when the supervisor is gone."""
        try:
            return await self.supervisor.call(message)
        except ChannelError as e:
            raise Unavailable(f"worker {self.index}: the supervisor is not answering ({e})") from None

    async def counts(self, worker: int, name: str, version: str) -> Counts:
        """Worker `worker`'s own counts of `name` (every model: ""); none when it does not answer in time."""
        try:
            answer: Counts = await self.workers[worker].call(("statistics", name, version), PEER_TIMEOUT_S)
        except (ChannelError, ServingError):
            return []
        return answer


class WorkerPlane(DataPlane):
    """The data plane of one worker (`link` set): load, unload and sequences as service/workers/ says."""

    link: WorkerLink | None = None

    async def load(self, name: str, parameters: Mapping[str, Parameter], repository: str = "") -> None:
        if self.link is None:
            return await super().load(name, parameters, repository)
        self._may_change_repository(repository)
        await self.link.everywhere(("load", self.link.index, name, dict(parameters)))

    async def unload(self, name: str, repository: str = "") -> None:
        if self.link is None:
            return await super().unload(name, repository)
        self._may_change_repository(repository)
        await self.link.everywhere(("unload", self.link.index, name))

    async def apply_load(self, name: str, parameters: dict[str, Parameter]) -> None:
        """The supervisor's load, on this worker."""
        await DataPlane.load(self, name, parameters)

    async def apply_unload(self, name: str) -> None:
        await DataPlane.unload(self, name)

    async def summed_statistics(self, name: str = "", version: str = "") -> list[ServedVersion]:
        """Every worker's counts summed (service/workers/statistics.py), the others asked while this worker
        goes on serving; its own counted once they have answered."""
        link = self.link
        if link is None or link.count == 1:
            return self.statistics(name, version)
        self.statistics(name, version)  # a model not served here: refused before asking the others
        others = await asyncio.gather(*(link.counts(i, name, version) for i in range(link.count) if i != link.index))
        return cast(list[ServedVersion], summed(self.statistics(name, version), list(others)))

    def own_statistics(self, name: str, version: str) -> list[tuple[str, str, ModelStats]]:
        """This worker's counts alone (what it adds to another's answer)."""
        return [(m.name, m.version, m.stats) for m in DataPlane.statistics(self, name, version)]

    async def infer(self, request: InferRequest) -> InferResponse | ServingError:
        link = self.link
        sequence = request.parameters.get("sequence_id") if link is not None and not request.step_of else None
        if link is None or not sequence or isinstance(sequence, bool):
            return await super().infer(request)
        worker = owner(sequence, link.count)
        if worker == link.index:
            return await super().infer(request)
        forwarded = self._forwardable(request)
        if forwarded is None:  # refused here as it would be there: the data plane says why, and counts it
            return await super().infer(request)
        try:
            answer: InferResponse | ServingError = await link.workers[worker].call(("infer", forwarded))
        except ChannelError:
            return Unavailable(
                f"worker {worker}, which holds sequence {quote(str(sequence))}, is not answering (restarting): retry"
            )
        except ServingError as e:
            return e
        return answer

    def _forwardable(self, request: InferRequest) -> InferRequest | None:
        """The request with its inputs read into arrays (each within the model's limits), free of this
        process (no trace context, no views of a message); None when it cannot be (the model or an input
        is refused)."""
        try:
            model = self.model(request.model_name, request.model_version)
            known = {s.name for s in model.metadata.inputs}
            if any(t.name not in known for t in request.inputs):
                return None
            inputs = [InferInput.of(t.name, t.read(input_limits(model, t.name))) for t in request.inputs]
        except ServingError:
            return None
        return InferRequest(
            request.model_name,
            request.model_version,
            request.id,
            inputs,
            [RequestedOutput(o.name, dict(o.parameters)) for o in request.outputs],
            dict(request.parameters),
            request.deadline,  # CLOCK_MONOTONIC: one clock for every process of the host
            method=request.method,
            caller=request.caller,
        )

    async def apply_infer(self, request: InferRequest) -> InferResponse | ServingError:
        """A request forwarded by another worker: this one holds its sequence."""
        return await DataPlane.infer(self, request)


class WorkerRegions(SharedMemoryRegistry):
    """The shared memory regions of one worker (`link` set): a change here is applied on every worker."""

    link: WorkerLink | None = None

    async def change(self, operation: str, *args: Any) -> None:
        await super().change(operation, *args)
        if self.link is not None:
            await self.link.everywhere(("regions", self.link.index, operation, args))
