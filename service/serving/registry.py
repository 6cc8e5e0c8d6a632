"""Which models and versions are served, and changing that while the server keeps answering.

Model control, with Triton's names (`--model-control-mode`):

- none: every model of the repository is loaded at start, and the set never changes.
- explicit: the `--load-model` models at start; RepositoryModelLoad / RepositoryModelUnload change it.
- poll: every model at start, then the repository is read again every `--repository-poll-secs`, and
  versions (and models) added, changed or removed on disk are loaded and unloaded to match.

A change never interrupts serving. New versions are built (sessions, warm-up) on a thread of their own
beside the serving ones and take traffic only once all are ready; a version that leaves stops taking
requests at once, finishes those queued or running on it, and then frees its sessions. A load that
fails (a config that does not parse, a corrupt or missing graph, inputs that differ from the config,
a failed warm-up) leaves what was serving in place, and the index says why.

Each load and unload is a task the registry owns: the RPC that asked for it awaits it shielded, so a client
that leaves (its call cancelled) does not stop it half done; changes of one model run one after another.
A version whose scheduler dies is taken out of service (UNAVAILABLE, the index says why) and freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from service.config import ServerSettings
from service.errors import ConfigError, InvalidArgument, NotFound, ServingError, Unavailable, quote
from service.models.catalog import (
    BATCHING_SHOWN,
    Context,
    ServedVersion,
    Steps,
    TunesBatching,
    build,
    capability,
    lifecycle,
    load_checked,
)
from service.models.response_cache import ResponseCache
from service.models.runtime import choose_providers
from service.models.warmup_samples import warm_up_with_samples
from service.observability.metrics import Metrics
from service.priority import ComputeThreads
from service.repository.layout import (
    ModelConfig,
    RepositoryError,
    config_fingerprint,
    dependencies,
    fingerprint,
    model_directories,
)
from service.serving.memory import return_freed_memory

if TYPE_CHECKING:  # only a tracing server imports it (and opentelemetry)
    from service.observability.tracing import Tracing

__all__ = [
    "BATCHING_SHOWN",
    "LOADING",
    "READY",
    "UNAVAILABLE",
    "UNLOADING",
    "LoadFailed",
    "Model",
    "ModelRegistry",
    "VersionState",
]

log = logging.getLogger("qkv.registry")

Model = ServedVersion  # of any kind (service/models/catalog.py)
READY, LOADING, UNLOADING, UNAVAILABLE = "READY", "LOADING", "UNLOADING", "UNAVAILABLE"
UNLOADED = "unloaded"  # the reason of a model unloaded on request: not counted against readiness


class LoadFailed(InvalidArgument):
    """A load that failed; `reason` is the problem alone (the file, relative to the repository, and what
    is wrong with it), as clients see it; `detail` the same with the server's paths, for its operator."""

    def __init__(self, name: str, reason: str, detail: str = "") -> None:
        super().__init__(f"failed to load '{name}': {reason}")
        self.reason = reason
        self.detail = detail or reason


@dataclass(frozen=True)
class VersionState:
    """One row of the repository index."""

    name: str
    version: str
    state: str
    reason: str = ""


@dataclass
class ServedModel:
    """One model name: the versions taking requests, and what the last change did."""

    directory: Path
    versions: dict[str, Model] = field(default_factory=dict)
    prints: dict[str, Any] = field(default_factory=dict)  # version -> its files and config.json, when built
    seen: Any = None  # the model directory's files at the last finished load: poll mode reloads when they change
    states: dict[str, VersionState] = field(default_factory=dict)  # versions loading, unloading or failed
    reason: str = ""  # why no version is ready, when none is
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one change at a time

    def ordered(self) -> list[Model]:
        """The versions taking requests, oldest first."""
        return [self.versions[v] for v in sorted(self.versions, key=int)]


_VERSION_STRING = re.compile(r"\s*[+-]?[0-9]+")  # what C++'s std::stol, which Triton reads it with, accepts


def check_version_string(version: str) -> None:
    """A version that is no integer, or is negative, refused INVALID_ARGUMENT in Triton's words (its
    GetModelVersionFromString: clients match on them)."""
    if not _VERSION_STRING.match(version):
        raise InvalidArgument(
            f"failed to get model version from specified version string {quote(version)} (details: stol), version "
            "should be an integral value > 0"
        )
    if version.strip().startswith("-"):
        raise InvalidArgument(
            f"invalid model version specified {quote(version)} , version should be an integral value > 0"
        )


class ModelRegistry:
    """The served models, by name and version, and the loads and unloads that change them.

    Reads (`get`, `served`, `index`) happen on the event loop and never wait. Changes run one at a time
    per model; building runs on a worker thread, and the swap itself happens on the event loop between
    two requests, so a request sees either the old versions or the new ones.
    """

    def __init__(
        self,
        settings: ServerSettings,
        metrics: Metrics,
        changed: Callable[[str, bool], Awaitable[None]] | None = None,
        tracing: Tracing | None = None,
        cache: ResponseCache[Any] | None = None,
        steps: Steps | None = None,
        compute: ComputeThreads | None = None,
    ) -> None:
        self.root = Path(settings.model_repository)
        self.cache = cache  # a leaving version's kept answers go with it
        self.mode = settings.model_control_mode
        self.exit_on_error = settings.exit_on_error
        self.poll_seconds = settings.repository_poll_secs
        self.metrics = metrics
        self.providers = choose_providers(settings.device)
        self.models: dict[str, ServedModel] = {}
        self._changed = changed  # (name, ready): health follows the models
        self.tracing = tracing  # handed to each version's batcher or scheduler
        self._poller: asyncio.Task[None] | None = None
        self._changes: set[asyncio.Task[None]] = set()  # loads and unloads under way, owned here
        self._closing = False
        self.started = False  # set once the start's models are loaded
        self.initial = settings.load_model if self.mode == "explicit" else ("*",)
        self.steps = steps  # the server's data plane: the ensembles built here run their steps there
        # the server's compute threads (their priority, their cores): each version built here runs on them
        self.compute = compute or ComputeThreads(settings.compute_nice)

    # Reads: on the event loop, never waiting.

    def get(self, name: str, version: str = "") -> Model:
        """The version asked for, or the newest ready one."""
        served = self.models.get(name)
        if served is None:
            raise NotFound(
                f"Request for unknown model: {quote(name)} is not found "
                f"(served: {', '.join(self.ready_names()) or 'none'})"
            )
        if not served.versions:
            raise Unavailable(
                f"Request for unknown model: '{name}' has no available versions: {served.reason or 'not loaded'}"
            )
        if not version:
            return served.ordered()[-1]
        check_version_string(version)
        model = served.versions.get(version)
        if model is None:
            raise NotFound(
                f"Request for unknown model: '{name}' version {quote(version)} is not found (served versions: "
                f"{', '.join(sorted(served.versions))})"
            )
        return model

    def ready_names(self) -> list[str]:
        return sorted(name for name, s in self.models.items() if s.versions)

    def served(self) -> list[Model]:
        """Every version taking requests."""
        return [m for s in self.models.values() for m in s.ordered()]

    def versions(self, name: str) -> list[Model]:
        self.get(name)
        return self.models[name].ordered()

    def index(self, ready_only: bool = False) -> list[VersionState]:
        """Every model of the repository (and every one still served): each version's state and reason."""
        rows: list[VersionState] = []
        try:
            on_disk = set(model_directories(self.root))
        except RepositoryError:
            on_disk = set()
        for name in sorted(on_disk | set(self.models)):
            served = self.models.get(name)
            if served is None:
                rows.append(VersionState(name, "", UNAVAILABLE, "not loaded"))
                continue
            versions = {v: VersionState(name, v, READY) for v in served.versions} | served.states
            if not versions:
                rows.append(VersionState(name, "", UNAVAILABLE, served.reason or "not loaded"))
            rows += [versions[v] for v in sorted(versions, key=int)]
        return [r for r in rows if r.state == READY] if ready_only else rows

    # Changes.

    async def start(self) -> None:
        """The models served from the start. One that fails to load stops the start (--exit-on-error, Triton's
        default); with --no-exit-on-error it is UNAVAILABLE, the index and the log say why, and the others serve."""
        names = list(model_directories(self.root)) if "*" in self.initial else list(self.initial)
        if self.mode != "explicit" and not names:
            raise RepositoryError(f"model repository {self.root} holds no models")
        for name in names:
            if name in self.models and self.models[name].versions:
                continue  # loaded already, as a step of an ensemble loaded before it
            try:
                await self.load(name)
            except ServingError as e:
                detail = e.detail if isinstance(e, LoadFailed) else e.message
                if self.exit_on_error:
                    raise RepositoryError(detail) from None
                log.error("model '%s' is UNAVAILABLE: %s (--exit-on-error false: the others serve)", name, detail)
        self.started = True
        if self.mode == "poll":
            self._poller = asyncio.create_task(self._poll())

    def unavailable(self) -> list[str]:
        """The models loaded or tried (and not unloaded since) without a version taking requests: their loads
        failed, or are under way. --strict-readiness makes the server ready only when there are none."""
        return sorted(name for name, s in self.models.items() if not s.versions and s.reason != UNLOADED)

    async def load(self, name: str, raw: dict[str, Any] | None = None, _loading: tuple[str, ...] = ()) -> None:
        """Load `name` (or reload it: versions whose files and config are unchanged are kept as they are).

        `raw`: a config.json to use instead of the file. Raises a ServingError saying why the load failed;
        the versions that were serving keep serving. The models an ensemble runs as its steps are loaded
        first when they are not served (`_loading`: the ensembles whose loads led here, against cycles)."""
        try:
            directory = model_directories(self.root).get(name)
        except RepositoryError:  # the repository itself is gone
            directory = None
        if directory is None:
            raise NotFound(
                f"failed to load {quote(name)}, failed to poll from model repository: no model {quote(name)} in it"
            )
        for step_model in dependencies(directory, raw):
            step = self.models.get(step_model)
            if step_model in (name, *_loading) or (step is not None and step.versions):
                continue  # served already, or a cycle (which the ensemble's own load refuses, saying so)
            with contextlib.suppress(ServingError):  # the ensemble's load names the step that is not served, and why
                await self.load(step_model, None, (*_loading, name))
        served = self.models.setdefault(name, ServedModel(directory))
        await self._change(served, partial(self._load, served, name, raw))

    async def _change(self, served: ServedModel, change: Callable[[], Awaitable[None]]) -> None:
        """Run `change` as a task of the registry's, after the model's changes before it, and await its end.
        Shielded: the caller being cancelled (its client left) leaves the change running to its end."""
        await asyncio.shield(self._start_change(served, change, refused_at_shutdown=True))

    def _start_change(
        self, served: ServedModel, change: Callable[[], Awaitable[None]], refused_at_shutdown: bool = False
    ) -> asyncio.Task[None]:
        async def serialized() -> None:
            async with served.lock:
                if refused_at_shutdown and self._closing:
                    raise Unavailable("the server is shutting down")
                await change()

        task = asyncio.create_task(serialized())
        self._changes.add(task)
        task.add_done_callback(self._changed_done)
        return task

    def _changed_done(self, task: asyncio.Task[None]) -> None:
        self._changes.discard(task)
        if not task.cancelled() and not isinstance(task.exception(), ServingError | None):
            log.error("a model change failed", exc_info=task.exception())  # a ServingError is the caller's answer

    async def _load(self, served: ServedModel, name: str, raw: dict[str, Any] | None) -> None:
        loop = asyncio.get_running_loop()
        seen = fingerprint(served.directory)
        try:
            configs = await loop.run_in_executor(None, load_checked, served.directory, raw)
        except (RepositoryError, ConfigError) as e:
            served.states = {}
            served.reason = self.private(str(e))
            served.seen = seen  # the files are at fault: tried again once they change
            if self.started:  # a failure at start is the start's error, said once
                log.warning("model '%s': load failed: %s", name, e)
            raise LoadFailed(name, served.reason, str(e)) from None
        config_print = config_fingerprint(served.directory) if raw is None else raw
        keep: dict[str, Model] = {}
        build: list[ModelConfig] = []
        prints = {}
        for c in configs:
            prints[c.version] = (fingerprint(c.directory), config_print)
            if c.version in served.versions and served.prints.get(c.version) == prints[c.version]:
                keep[c.version] = served.versions[c.version]
            else:
                build.append(c)
        served.states = {c.version: VersionState(name, c.version, LOADING) for c in build}
        built: list[Model] = []
        for c in build:
            started = time.perf_counter()
            try:
                built.append(await loop.run_in_executor(None, self._build, c))
            except Exception as e:
                for m in built:
                    lifecycle(m).release()
                served.seen = seen
                self._failed(served, name, c.version, e)
            log.info("model '%s' version %s built in %.2f s", name, c.version, time.perf_counter() - started)
        for m in built:
            self._activate(m)
        leaving = [m for v, m in served.versions.items() if keep.get(v) is not m]
        served.versions = keep | {m.version: m for m in built}  # the swap: new requests reach the new set
        served.prints = prints
        served.seen = seen
        served.reason = ""
        served.states = {m.version: VersionState(name, m.version, UNLOADING) for m in leaving}
        log.info("model '%s': %s", name, self._serving(served))
        await self._notify(name, True)
        await self._retire(served, leaving)

    def _failed(self, served: ServedModel, name: str, failed: str, e: Exception) -> NoReturn:
        """A version failed to build: what was serving stays, the index says why, the caller is told."""
        detail = e.message if isinstance(e, ServingError) else str(e)
        message = self.private(detail)
        served.states = {failed: VersionState(name, failed, UNAVAILABLE, message)}
        if not served.versions:
            served.reason = message
        log.warning("model '%s': load failed, %s: %s", name, self._serving(served), detail)
        raise LoadFailed(name, message, detail) from None

    def private(self, message: str) -> str:
        """`message` as a client may see it: a path inside the repository relative to it (g2p/1/model.onnx),
        and nothing of where the repository lies on the server."""
        forms = {str(self.root.resolve()), str(self.root.absolute())}
        for root in sorted((f for f in forms if f != "/"), key=len, reverse=True):
            message = message.replace(root + "/", "").replace(root, "<model repository>")
        return message

    async def unload(self, name: str) -> None:
        """Stop serving `name`: new requests are refused at once; queued and running ones finish first."""
        served = self.models.get(name)
        if served is None:
            raise NotFound(
                f"Request for unknown model: {quote(name)} is not found "
                f"(loaded: {', '.join(self.ready_names()) or 'none'})"
            )
        await self._change(served, partial(self._unload, served, name))

    async def _unload(self, served: ServedModel, name: str) -> None:
        leaving = list(served.versions.values())
        served.versions, served.prints = {}, {}
        served.reason = UNLOADED
        served.states = {m.version: VersionState(name, m.version, UNLOADING) for m in leaving}
        await self._notify(name, False)
        await self._retire(served, leaving)
        log.info("model '%s' unloaded", name)

    def version_failed(self, m: Model, error: ServingError) -> None:
        """On the event loop: `m`'s scheduler died. It leaves service at once (the index says why) and is
        freed; poll mode loads the model again at its next poll."""
        served = self.models.get(m.name)
        if served is None or served.versions.get(m.version) is not m:
            return
        del served.versions[m.version]
        served.prints.pop(m.version, None)
        served.seen = None
        dead = VersionState(m.name, m.version, UNAVAILABLE, error.message)
        served.states[m.version] = dead
        if not served.versions:
            served.reason = error.message
        log.error("model '%s' version %s taken out of service: %s", m.name, m.version, error.message)

        async def retire() -> None:  # after the changes under way: the lock is held
            if not served.versions:
                await self._notify(m.name, False)
            await self._retire(served, [m])
            if m.version not in served.versions:  # unless a load since has built it again
                served.states.setdefault(m.version, dead)

        self._start_change(served, retire)

    async def close(self, grace: float | None = None) -> None:
        """At shutdown: stop polling; changes under way end, and every version finishes what it holds,
        within `grace` seconds (then what is left is abandoned, and said)."""
        self._closing = True
        if self._poller is not None:
            self._poller.cancel()
        closing = [asyncio.create_task(lifecycle(m).close()) for m in self.served()]
        waiting = {*self._changes, *closing}
        if waiting:
            _, late = await asyncio.wait(waiting, timeout=grace)
            if late:
                log.warning("shutdown: %d model change(s) or version(s) still busy after the grace period", len(late))

    # Parts.

    def _build(self, config: ModelConfig) -> Model:
        """On a worker thread: sessions (loaded at compute priority) and warm-up."""
        observer = self.metrics.observer(config.name, config.version)
        model = build(config, Context(self.providers, observer, self.cache, self.steps, self.compute))
        try:
            lifecycle(model).warm_up()
            warm_up_with_samples(model, config.warmup, config.directory.parent)  # a Triton config's model_warmup
        except BaseException:
            lifecycle(model).release()
            raise
        return model

    def _activate(self, m: Model) -> None:
        """On the event loop: the model's batcher starts, and the metrics show it."""
        self.metrics.model_info.labels(m.name, m.version, m.metadata.provider).set(1)
        tunes = capability(m, TunesBatching)
        if tunes is not None and tunes.batching_sources() is not None:  # a kind that tunes it shows what it chose
            batching = tunes.batching()
            for key in BATCHING_SHOWN:
                self.metrics.batching_setting.labels(m.name, m.version, key).set(float(getattr(batching, key)))
        lifecycle(m).start(self.tracing, partial(self.version_failed, m))

    async def _retire(self, served: ServedModel, leaving: list[Model]) -> None:
        """Let versions that no longer take requests finish theirs, then free them and their series."""
        for m in leaving:
            await m.in_flight.idle()  # every request that reached it answered (and counted in the metrics)
            await lifecycle(m).close()
            lifecycle(m).release()
            served.states.pop(m.version, None)
            if self.cache is not None:  # a version reloaded in place may answer otherwise
                self.cache.drop(m.name, m.version)
            if m.version not in served.versions:  # a version reloaded in place keeps its series
                self.metrics.forget(m.name, m.version)
        if leaving:
            gc.collect()
            return_freed_memory()

    async def _notify(self, name: str, ready: bool) -> None:
        if self._changed is not None:
            await self._changed(name, ready)

    @staticmethod
    def _serving(served: ServedModel) -> str:
        return f"serving version(s) {', '.join(sorted(served.versions, key=int)) or 'none'}"

    async def _poll(self) -> None:
        """Poll mode: match the repository on disk, forever."""
        while True:
            await asyncio.sleep(self.poll_seconds)
            try:
                await self.sync()
            except Exception:  # one bad poll does not end polling
                log.exception("repository poll failed")

    async def sync(self) -> None:
        """Load models added or changed on disk since their last load, and unload those removed."""
        try:
            on_disk = model_directories(self.root)
        except RepositoryError as e:
            log.warning("repository poll: %s", e)
            return
        for name in sorted(set(self.models) - set(on_disk)):
            if self.models[name].versions:
                await self.unload(name)
            del self.models[name]
        for name, directory in on_disk.items():
            served = self.models.get(name)
            if served is not None and fingerprint(directory) == served.seen:
                continue
            try:
                await self.load(name)
            except ServingError as e:
                log.warning("repository poll: %s", e.message)
