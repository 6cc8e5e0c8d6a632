"""Which local user a TCP peer is, and what that user may do to a file: what shared memory registration
checks, so that a client reaches through the server only the objects it could open itself.

A connection between two sockets of this host is listed twice in /proc/net/tcp (or tcp6): once for each
end, each line with the uid that owns the socket. The peer's end is the line whose local address is the
peer's address and port and whose remote address is the server's (as identd finds a connection's owner).
A peer beyond this host, or in another network namespace, has no such line: its uid is unknown (None).
Linux only: elsewhere every uid is unknown.
"""

from __future__ import annotations

import os
import pwd
import struct
import urllib.parse
from ipaddress import IPv6Address, ip_address
from pathlib import Path

__all__ = ["Address", "access", "grpc_address", "peer_uid"]

Address = tuple[str, int]  # host, port
TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
ESTABLISHED = "01"  # the `st` column of a connected socket
READ, WRITE = 4, 2  # the permission bits of one class (owner, group, others)


def grpc_address(peer: str) -> Address | None:
    """A gRPC peer ('ipv4:127.0.0.1:5000', 'ipv6:%5B::1%5D:5000') -> (host, port); None for any other
    ('unix:/path', 'unix-abstract:...')."""
    kind, _, rest = urllib.parse.unquote(peer).partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = rest.rpartition(":")
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        return None


def _packed(host: str) -> bytes | None:
    """An address as 4 bytes (IPv4, an IPv4-mapped IPv6 address included) or 16 (IPv6)."""
    try:
        address = ip_address(host.split("%", 1)[0])
    except ValueError:
        return None
    mapped = address.ipv4_mapped if isinstance(address, IPv6Address) else None
    return (mapped or address).packed


def _column(text: str) -> tuple[bytes, int]:
    """/proc/net/tcp's 'HEX:PORT': the kernel prints each 32-bit word of the address in the host's byte order."""
    host, port = text.split(":")
    raw = b"".join(struct.pack("=I", int(host[i : i + 8], 16)) for i in range(0, len(host), 8))
    if len(raw) == 16 and raw[:12] == b"\0" * 10 + b"\xff\xff":  # an IPv4 peer of an IPv6 socket
        raw = raw[12:]
    return raw, int(port, 16)


def peer_uid(peer: Address, server: Address, tables: tuple[Path, ...] = TABLES) -> int | None:
    """The uid owning the peer's end of the connection peer -> server (server's host "" or "::": any of this
    host's addresses), or None when no socket of this host is that end, or more than one user's is."""
    peer_host, server_host = _packed(peer[0]), _packed(server[0])
    if peer_host is None:
        return None
    any_host = server_host is None or not any(server_host)  # unknown, or the wildcard address
    uids = set()
    for table in tables:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:  # not Linux, or no IPv6
            continue
        for line in lines:
            columns = line.split()
            if len(columns) < 8 or columns[3] != ESTABLISHED:
                continue
            local, remote = _column(columns[1]), _column(columns[2])
            if local != (peer_host, peer[1]) or remote[1] != server[1]:
                continue
            if any_host or remote[0] == server_host:
                uids.add(int(columns[7]))
    return uids.pop() if len(uids) == 1 else None


def _groups(uid: int) -> set[int]:
    """The groups a user is in, by the system's user and group databases (empty for a uid it has not)."""
    try:
        user = pwd.getpwuid(uid)
    except KeyError:
        return set()
    return {user.pw_gid, *os.getgrouplist(user.pw_name, user.pw_gid)}


def access(uid: int, info: os.stat_result) -> tuple[bool, bool]:
    """Whether `uid` may read, and write, a file of owner, group and mode `info`: the mode bits of its class
    (owner, else group, else others), as the kernel decides for a process of that user; root may both.
    (POSIX ACLs are not read.)"""
    if uid == 0:
        return True, True
    mode = info.st_mode
    if uid == info.st_uid:
        bits = mode >> 6
    elif (mode >> 3) & 6 != mode & 6 and info.st_gid in _groups(uid):  # the groups only when they matter
        bits = mode >> 3
    else:
        bits = mode
    return bool(bits & READ), bool(bits & WRITE)
