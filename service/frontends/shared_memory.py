# Over 500 lines: Triton's shared memory extension whole: one security boundary in one place.
"""Triton's system shared memory extension: regions a client registers, tensors read from and written to them.

A region is a slice [offset, offset + byte_size) of a POSIX shared memory object, /dev/shm/KEY on the
server's host, registered under a name. An input tensor whose parameters name a region
(`shared_memory_region`, `shared_memory_byte_size`, `shared_memory_offset`) is read from it instead of
from the request; a requested output that names one is written into it, and the answer carries the
output's metadata only (docs/design.md, "System shared memory").

The server keeps each object's file descriptor open and reads and writes it with pread/pwrite, never
through a mapping: a client that truncates its object after registering it would make a read of a
mapping fault (SIGBUS, which kills the process); pread of a truncated object comes back short, which is
refused naming the region. Each copy is one, as from a mapping.

Each request leases the regions its tensors name, from before its inputs are decoded until its answer is
written. Unregistering takes a region out of the table at once (new requests get NOT_FOUND); its
descriptor closes when the last lease ends, so a request in flight never reads or writes another object.
Regions still leased count against the limits until then. Everything here runs on the event loop, except
an input's read (`RegionSource`, a `TensorSource` the data plane reads, on a worker thread for a large
request) while the request holds its leases.

The server may open more than its clients may (it often runs as root), so it never acts on an object for a
client beyond that client's own rights: the front end finds the peer's uid (service/frontends/peers.py);
registering opens the object read-only, write-only or both, as its owner, group and mode let the
registering uid, or refuses PERMISSION_DENIED when they let it do neither; and a request reads a region for
an input only if its own uid may read the object, writes one for an output only if it may write it (by
the object's mode at that request), and only within the rights the region was opened with. A peer whose
uid cannot be found is refused, unless the operator opted in (--shared-memory-unverified-peers); keys may
be bound to a prefix (--shared-memory-key-prefix). With --isolate-tokens each caller (service/callers.py)
has its own regions: another's are NOT_FOUND to it.
"""

from __future__ import annotations

import os
import stat
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import numpy as np

from service.callers import Caller, share_of
from service.datatypes import NUMPY_DTYPES, InputLimits
from service.errors import AlreadyExists, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted, quote
from service.frontends.codec import raw_array
from service.frontends.peers import access
from service.frontends.security import BearerTokens
from service.serving.dataplane_types import Parameter, checked_shape

__all__ = [
    "BYTE_SIZE",
    "CUDA_UNIMPLEMENTED",
    "OFFSET",
    "PARAMETERS",
    "REGION",
    "RegionSource",
    "RegionStatus",
    "RequestMemory",
    "SharedMemoryRegistry",
    "TensorRegion",
    "check_may_change",
    "peer_host",
]

SHM_DIRECTORY = Path("/dev/shm")  # where shm_open puts a POSIX shared memory object
REGION = "shared_memory_region"
OFFSET = "shared_memory_offset"
BYTE_SIZE = "shared_memory_byte_size"
PARAMETERS = (REGION, OFFSET, BYTE_SIZE)
MAX_NAME_CHARS = 256  # a region's name
MAX_KEY_CHARS = 255  # a shared memory object's name (NAME_MAX)
CUDA_UNIMPLEMENTED = (
    "qkv has no CUDA shared memory: register system shared memory (the system_shared_memory extension) instead"
)


@dataclass(frozen=True)
class RegionStatus:
    name: str
    key: str
    offset: int
    byte_size: int


class _Region:
    """A registered region: the object's open descriptor, whose it is, and the requests leasing it.

    `rights`: whether `fd` was opened for reading, and for writing (as the registering user may); `owner`:
    the caller's name with --isolate-tokens, "" otherwise."""

    def __init__(self, status: RegionStatus, fd: int, rights: tuple[bool, bool], owner: str) -> None:
        self.status, self.fd, self.rights, self.owner = status, fd, rights, owner
        self.leases = 0
        self.registered = True

    @property
    def name(self) -> str:
        return self.status.name

    def check_access(self, write: bool, what: str, uid: int | None, unverified: bool) -> None:
        """PERMISSION_DENIED unless the region was opened to be read (an input's) or written (an output's), and
        the requesting user `uid` may do that to the object by its mode now (None: a user the server cannot
        find, allowed only with `unverified`, --shared-memory-unverified-peers)."""
        done = "written" if write else "read"
        if not self.rights[1 if write else 0]:
            why = "it was registered by a user without that right"
        elif uid is None:
            if unverified:
                return
            why = "the server cannot tell which user of its host the client is"
        elif uid == 0:  # root may anything
            return
        else:
            info = os.fstat(self.fd)
            if access(uid, info)[1 if write else 0]:
                return
            why = _refusal(uid, self.status.key, info)
        raise PermissionDenied(f"{what}: shared memory region {quote(self.name)} may not be {done}: {why}")

    def _truncated(self, end: int) -> InvalidArgument:
        size = os.fstat(self.fd).st_size
        return InvalidArgument(
            f"shared memory region {quote(self.name)}: its object {quote(self.status.key)} now holds {size} bytes, "
            f"fewer than the {end} it held when registered"
        )

    def read(self, offset: int, size: int) -> bytes:
        """`size` bytes at `offset` in the region (bounds checked by the caller)."""
        start = self.status.offset + offset
        data = os.pread(self.fd, size, start)
        if len(data) < size:  # a regular file reads short only at its end
            raise self._truncated(start + size)
        return data

    def write(self, offset: int, data: memoryview) -> None:
        """`data` at `offset` in the region (bounds checked by the caller), never past the object's end."""
        start = self.status.offset + offset
        if os.fstat(self.fd).st_size < start + len(data):  # pwrite would grow a truncated object back
            raise self._truncated(start + len(data))
        done = 0
        while done < len(data):
            done += os.pwrite(self.fd, data[done:], start + done)


@dataclass(frozen=True)
class _Placement:
    """Where one tensor lies: a slice of a leased region."""

    region: _Region
    offset: int
    byte_size: int


@dataclass(frozen=True)
class TensorRegion:
    """A tensor of a request as the regions see it, whatever its transport: its name and parameters (those that
    may name a region); `has_data`: an input that carries contents of its own besides."""

    name: str
    parameters: Mapping[str, Parameter]
    has_data: bool = False


def _parameter(params: Mapping[str, Parameter], key: str, kind: type[str] | type[int], what: str) -> Parameter:
    value = params[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        wanted = "a string" if kind is str else "an integer"
        raise InvalidArgument(f"{what}: parameter {key!r} must be {wanted}")
    return value


def _wanted(tensor: TensorRegion, what: str) -> tuple[str, int, int] | None:
    """A tensor's (region, offset, byte size) parameters, when it names a region."""
    params = tensor.parameters
    if REGION not in params:
        for key in (OFFSET, BYTE_SIZE):
            if key in params:
                raise InvalidArgument(f"{what}: parameter {key!r} without {REGION!r}")
        return None
    name = str(_parameter(params, REGION, str, what))
    if BYTE_SIZE not in params:
        raise InvalidArgument(f"{what}: parameter {BYTE_SIZE!r} must come with {REGION!r}")
    byte_size = int(_parameter(params, BYTE_SIZE, int, what))
    offset = int(_parameter(params, OFFSET, int, what)) if OFFSET in params else 0
    return name, offset, byte_size


@dataclass(frozen=True)
class RegionSource:
    """An input's elements in a leased region (service/serving/dataplane_types.py's `TensorSource`): read, one
    pread into an array, only once its shape passed the model's limits and its byte size matches that shape.
    `max_bytes`: the most a BYTES input may take (--max-message-bytes), as its size follows from no shape."""

    placed: _Placement
    max_bytes: int

    def read(self, name: str, datatype: str, shape: Sequence[int], limits: InputLimits) -> np.ndarray:
        checked, count = checked_shape(name, datatype, shape, limits)
        placed = self.placed
        if datatype != "BYTES":
            needed = count * np.dtype(NUMPY_DTYPES[datatype]).itemsize
            if placed.byte_size != needed:
                raise InvalidArgument(
                    f"input {quote(name)}: {BYTE_SIZE} is {placed.byte_size}, shape {list(checked)} of {datatype} "
                    f"needs {needed} (region {quote(placed.region.name)})"
                )
        elif placed.byte_size > self.max_bytes:
            raise InvalidArgument(
                f"input {quote(name)}: {BYTE_SIZE} is {placed.byte_size}, the limit for BYTES is {self.max_bytes} "
                "(--max-message-bytes)"
            )
        raw = placed.region.read(placed.offset, placed.byte_size)
        return raw_array(name, datatype, checked, count, raw, limits)


class RequestMemory:
    """The regions one request reads inputs from and writes outputs to, leased until `close`."""

    def __init__(self, registry: SharedMemoryRegistry, owner: str, uid: Callable[[], int | None]) -> None:
        self._registry, self._owner = registry, owner
        self._uid_of, self._uid_known = uid, False  # the requesting user, found when first needed
        self._uid: int | None = None
        self._leased: list[_Region] = []
        self.inputs: dict[str, _Placement] = {}
        self.outputs: dict[str, _Placement] = {}

    def _place(self, tensor: TensorRegion, what: str, write: bool) -> _Placement | None:
        wanted = _wanted(tensor, what)
        if wanted is None:
            return None
        name, offset, byte_size = wanted
        region = self._registry.lease(name, what, self._owner)
        self._leased.append(region)
        region.check_access(write, what, self._requester(), self._registry.unverified_peers)
        size = region.status.byte_size
        if offset < 0 or byte_size < 0 or offset + byte_size > size:
            raise InvalidArgument(
                f"{what}: offset {offset} and byte size {byte_size} lie outside shared memory region "
                f"{quote(name)} ({size} bytes)"
            )
        return _Placement(region, offset, byte_size)

    def _requester(self) -> int | None:
        if not self._uid_known:
            self._uid, self._uid_known = self._uid_of(), True
        return self._uid

    def source(self, name: str) -> RegionSource | None:
        """Where input `name`'s elements are, read when the data plane asks; None for an input that names no
        region."""
        placed = self.inputs.get(name)
        return None if placed is None else RegionSource(placed, self._registry.max_tensor_bytes)

    def write(self, name: str, data: bytes) -> dict[str, Parameter] | None:
        """Output `name`'s raw contents written into its region, and the parameters that say where they went
        (`shared_memory_byte_size`: the bytes written); None when it names no region."""
        placed = self.outputs.get(name)
        if placed is None:
            return None
        if len(data) > placed.byte_size:
            raise InvalidArgument(
                f"output {quote(name)} is {len(data)} bytes, its {BYTE_SIZE} in region "
                f"{quote(placed.region.name)} is {placed.byte_size}"
            )
        placed.region.write(placed.offset, memoryview(data))
        where: dict[str, Parameter] = {REGION: placed.region.name, BYTE_SIZE: len(data)}
        if placed.offset:
            where[OFFSET] = placed.offset
        return where

    def close(self) -> None:
        """Every lease handed back (once: later calls do nothing)."""
        leased, self._leased = self._leased, []
        for region in leased:
            self._registry.release(region)


def _key_name(key: str) -> str:
    """shm_open's name -> the file's name in SHM_DIRECTORY: one leading '/' at most, no other."""
    name = key[1:] if key.startswith("/") else key
    if not name or len(name) > MAX_KEY_CHARS or "/" in name or "\0" in name or name in (".", ".."):
        raise InvalidArgument(
            f"shared memory key {quote(key)} is not the name of a POSIX shared memory object: '/NAME', "
            f"NAME of 1 to {MAX_KEY_CHARS} characters without '/'"
        )
    return name


def _refusal(uid: int, key: str, info: os.stat_result) -> str:
    return (
        f"uid {uid} may not open {quote(key)} so (owner uid {info.st_uid}, group {info.st_gid}, "
        f"mode {stat.S_IMODE(info.st_mode):04o}), and the server opens it with no more rights than its client"
    )


def _owner(caller: Caller | None) -> str:
    return caller.name if caller is not None else ""


class SharedMemoryRegistry:
    """The registered regions, within --shared-memory-max-regions and --shared-memory-max-bytes (and, with
    --isolate-tokens, each caller's share of them); `key_prefix`: the names keys must start with
    (--shared-memory-key-prefix); `unverified_peers`: register for a peer whose uid is not known, with the
    server's own rights (--shared-memory-unverified-peers)."""

    def __init__(
        self,
        max_regions: int,
        max_bytes: int,
        max_tensor_bytes: int,
        directory: Path = SHM_DIRECTORY,
        key_prefix: str = "",
        unverified_peers: bool = False,
    ) -> None:
        self.max_regions, self.max_bytes, self.max_tensor_bytes = max_regions, max_bytes, max_tensor_bytes
        self.directory, self.key_prefix, self.unverified_peers = directory, key_prefix.lstrip("/"), unverified_peers
        self._regions: dict[tuple[str, str], _Region] = {}  # (owner, name): each caller's names are its own
        self._open: set[_Region] = set()  # registered or still leased: what the limits count

    @property
    def extensions(self) -> list[str]:
        """The server metadata's extension names for this one (none when it is off)."""
        return ["system_shared_memory"] if self.max_regions > 0 else []

    def register(
        self, name: str, key: str, offset: int, byte_size: int, uid: int | None, caller: Caller | None = None
    ) -> None:
        """Region `name`: [offset, offset + byte_size) of object `key`, for a peer of user `uid` (None: not
        known) and `caller` (--isolate-tokens)."""
        if self.max_regions <= 0:
            raise ResourceExhausted("system shared memory is off (--shared-memory-max-regions 0)")
        if not name or len(name) > MAX_NAME_CHARS:
            raise InvalidArgument(f"a shared memory region's name must have 1 to {MAX_NAME_CHARS} characters")
        owner = _owner(caller)
        if (owner, name) in self._regions:
            old = self._regions[owner, name].status
            raise AlreadyExists(
                f"shared memory region {quote(name)} is already registered (key {quote(old.key)}): unregister it first"
            )
        file_name = _key_name(key)
        if not file_name.startswith(self.key_prefix):
            raise PermissionDenied(
                f"cannot register shared memory region {quote(name)}: key {quote(key)} does not start with "
                f"{quote('/' + self.key_prefix)} (--shared-memory-key-prefix)"
            )
        if uid is None and not self.unverified_peers:
            raise PermissionDenied(
                f"cannot register shared memory region {quote(name)}: the server cannot tell which user of its host "
                "the client is (a peer beyond this host, or not Linux), so it cannot open the object only as that "
                "user may (--shared-memory-unverified-peers opens it for such peers with the server's own rights)"
            )
        if byte_size <= 0:
            raise InvalidArgument(f"shared memory region {quote(name)}: byte_size must be positive")
        self._check_room(name, byte_size, caller)
        fd, rights = self._open_object(name, key, file_name, uid)
        try:
            info = os.fstat(fd)
            if offset + byte_size > info.st_size:
                raise InvalidArgument(
                    f"shared memory region {quote(name)}: offset {offset} and byte_size {byte_size} lie outside "
                    f"{quote(key)} ({info.st_size} bytes)"
                )
        except BaseException:
            os.close(fd)
            raise
        region = _Region(RegionStatus(name, key, offset, byte_size), fd, rights, owner)
        self._regions[owner, name] = region
        self._open.add(region)

    async def change(self, operation: str, *args: Any) -> None:
        """`register` or `unregister` with `args`, as the front ends call them: a worker's registry
        (service/workers/) applies the change on every worker before it returns."""
        if operation not in ("register", "unregister"):
            raise ValueError(operation)
        getattr(self, operation)(*args)

    def _check_room(self, name: str, byte_size: int, caller: Caller | None) -> None:
        """RESOURCE_EXHAUSTED when one more region, of `byte_size` bytes, passes a limit or the caller's share."""
        owner = _owner(caller)
        for regions, max_regions, max_bytes, whose in (
            (self._open, self.max_regions, self.max_bytes, ""),
            ({r for r in self._open if r.owner == owner}, share_of(self.max_regions, caller),
             share_of(self.max_bytes, caller), "this caller's share of "),
        ):  # fmt: skip
            if len(regions) >= max_regions:
                raise ResourceExhausted(
                    f"cannot register shared memory region {quote(name)}: {len(regions)} regions are open, "
                    f"{whose}the limit is {max_regions} (--shared-memory-max-regions)"
                )
            held = sum(r.status.byte_size for r in regions)
            if held + byte_size > max_bytes:
                raise ResourceExhausted(
                    f"cannot register shared memory region {quote(name)} of {byte_size} bytes: {held} are "
                    f"registered, {whose}the limit is {max_bytes} (--shared-memory-max-bytes)"
                )
            if caller is None or caller.share >= 1:
                break

    def _open_object(self, name: str, key: str, file_name: str, uid: int | None) -> tuple[int, tuple[bool, bool]]:
        """The object opened with the rights `uid` has on it (None: the server's own): first by its path alone
        (O_PATH: no right used, no symbolic link followed), then, the same file, for reading, writing or both."""
        try:
            path_fd = os.open(self.directory / file_name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotFound(
                f"cannot register shared memory region {quote(name)}: no shared memory object {quote(key)} "
                f"(in {self.directory})"
            ) from None
        except OSError as e:
            raise InvalidArgument(
                f"cannot register shared memory region {quote(name)}: cannot open {quote(key)}: {e.strerror}"
            ) from None
        try:
            info = os.fstat(path_fd)
            if not stat.S_ISREG(info.st_mode):  # a symbolic link (O_PATH opens it), a FIFO, a directory
                raise InvalidArgument(f"shared memory region {quote(name)}: {quote(key)} is not a shared memory object")
            read, write = (True, True) if uid is None else access(uid, info)
            if not read and not write:
                assert uid is not None
                raise PermissionDenied(
                    f"cannot register shared memory region {quote(name)}: {_refusal(uid, key, info)}"
                )
            flags = os.O_RDWR if read and write else os.O_RDONLY if read else os.O_WRONLY
            try:  # the file path_fd holds, whatever its name now names
                fd = os.open(f"/proc/self/fd/{path_fd}", flags | os.O_CLOEXEC | os.O_NONBLOCK)
            except OSError as e:
                raise InvalidArgument(
                    f"cannot register shared memory region {quote(name)}: cannot open {quote(key)}: {e.strerror}"
                ) from None
        finally:
            os.close(path_fd)
        return fd, (read, write)

    def status(self, name: str = "", caller: Caller | None = None) -> list[RegionStatus]:
        """Every registered region's status, or the one named (the caller's own, with --isolate-tokens)."""
        owner = _owner(caller)
        if not name:
            return [r.status for (o, _), r in self._regions.items() if o == owner]
        region = self._regions.get((owner, name))
        if region is None:
            raise NotFound(f"no shared memory region {quote(name)} is registered")
        return [region.status]

    def unregister(self, name: str = "", caller: Caller | None = None) -> None:
        """One region (every one of the caller's, when `name` is empty) out of the table; a region that is not
        registered is NOT_FOUND. Its descriptor closes once no request leases it."""
        owner = _owner(caller)
        if name and (owner, name) not in self._regions:
            raise NotFound(f"no shared memory region {quote(name)} is registered")
        for region in [self._regions[owner, name]] if name else [r for r in self._regions.values() if r.owner == owner]:
            self._drop(region)

    def _drop(self, region: _Region) -> None:
        del self._regions[region.owner, region.name]
        region.registered = False
        if region.leases == 0:
            self._close(region)

    def _close(self, region: _Region) -> None:
        self._open.discard(region)
        os.close(region.fd)

    def lease(self, name: str, what: str, owner: str = "") -> _Region:
        region = self._regions.get((owner, name))
        if region is None:
            raise NotFound(f"{what}: no shared memory region {quote(name)} is registered")
        region.leases += 1
        return region

    def release(self, region: _Region) -> None:
        region.leases -= 1
        if region.leases == 0 and not region.registered:
            self._close(region)

    def attach(
        self,
        inputs: Iterable[TensorRegion],
        outputs: Iterable[TensorRegion],
        uid: Callable[[], int | None],
        caller: Caller | None = None,
    ) -> RequestMemory | None:
        """The regions a request's tensors name, leased, bounds- and rights-checked (`uid`: the requesting user,
        asked for only when a tensor names a region); None when they name none. A front end hands over only
        the tensors that have parameters: most have none."""
        memory = RequestMemory(self, _owner(caller), uid)
        try:
            for tensor in inputs:
                if not len(tensor.parameters):
                    continue
                what = f"input {quote(tensor.name)}"
                placed = memory._place(tensor, what, write=False)
                if placed is not None:
                    if tensor.has_data:
                        raise InvalidArgument(f"{what}: both contents and a shared memory region given")
                    memory.inputs[tensor.name] = placed
            for tensor in outputs:
                if not len(tensor.parameters):
                    continue
                placed = memory._place(tensor, f"output {quote(tensor.name)}", write=True)
                if placed is not None:
                    memory.outputs[tensor.name] = placed
        except BaseException:
            memory.close()
            raise
        return memory if memory.inputs or memory.outputs else None

    def close(self) -> None:
        """At drain: every region, of every caller, unregistered."""
        for region in list(self._regions.values()):
            self._drop(region)


def _loopback(host: str) -> bool:
    try:
        address = ip_address(host)
    except ValueError:
        return host == "localhost"
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def peer_host(peer: str) -> str:
    """A gRPC peer ('ipv4:127.0.0.1:5000', 'ipv6:%5B::1%5D:5000', 'unix:/path') -> its address ('unix' for a
    Unix socket)."""
    kind, _, rest = urllib.parse.unquote(peer).partition(":")
    if kind == "unix":
        return "unix"
    return rest.rsplit(":", 1)[0].strip("[]")


def check_may_change(host: str | None, authorization: str | None, tokens: BearerTokens, what: str) -> None:
    """Registering or unregistering: a region names a file on the server's host, so only a client on that host
    (loopback, or a Unix socket), or one offering an admin bearer token, may."""
    if host is not None and (host == "unix" or _loopback(host)):
        return
    if tokens.admin and tokens.allows(authorization, repository=True):
        return
    raise PermissionDenied(
        f"{what} from {quote(host or 'an unknown peer')} is refused: a region names a file on the server's host, "
        "so only a loopback client, or one with an admin bearer token (--admin-token-file), may"
    )
