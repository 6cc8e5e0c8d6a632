"""Which local user a TCP peer is, and what that user may do to a file: what shared memory checks, so that a
client reaches through the server only the objects it could open itself.

A connection between two sockets of this host has both ends on it, each owned by the uid that made it. The
peer's end is the socket whose local address and port are the peer's and whose remote address and port
are the server's; its owner is the client's user (as identd finds a connection's owner). The kernel is
asked for that one socket by its addresses (sock_diag over netlink, an exact lookup: some 35 us), or,
where netlink is not to be had, the socket is looked for in /proc/net/tcp and tcp6 (which the kernel
writes out whole on each read: 10-20 ms on a host with a few hundred sockets). A peer beyond this host, or
in another network namespace, has no such socket: its uid is unknown (None). Linux only: elsewhere every
uid is unknown.
"""

from __future__ import annotations

import itertools
import os
import pwd
import socket
import struct
import threading
import urllib.parse
from ipaddress import IPv6Address, ip_address
from pathlib import Path

__all__ = ["Address", "access", "grpc_address", "grpc_peer_uid", "peer_uid"]

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


def grpc_peer_uid(peer: str, server: Address) -> int | None:
    """`peer_uid` of a gRPC call's peer ('ipv4:127.0.0.1:5000'); None for a peer that is no TCP address."""
    address = grpc_address(peer)
    return None if address is None else peer_uid(address, server)


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


def peer_uid(peer: Address, server: Address) -> int | None:
    """The uid owning the peer's end of the connection peer -> server (server's host "", "0.0.0.0" or "::":
    any of this host's addresses), or None when no socket of this host is that end."""
    peer_host, server_host = _packed(peer[0]), _packed(server[0])
    if peer_host is None:
        return None
    # A connection to one of this host's own addresses comes from that same address: the peer's, when the
    # server's own end is not known (a wildcard bind); otherwise the server's. Its 4-tuple names one socket.
    host = peer_host if server_host is None or not any(server_host) else server_host
    try:
        diag = _diag_socket()
    except (OSError, AttributeError):  # no netlink here (not Linux, or a sandbox without it)
        return _proc_uid(peer, server)
    try:
        for family, local, remote in _queries(peer_host, host):
            uid = _diag_uid(diag, family, (local, peer[1]), (remote, server[1]))
            if uid is not None:
                return uid
    except OSError:  # no answer in time: the socket is dropped, with whatever answer may still come
        _local.__dict__.pop("diag", None)
        diag.close()
    return None


NETLINK_SOCK_DIAG = 4  # linux/netlink.h
SOCK_DIAG_BY_FAMILY = 20  # linux/sock_diag.h
NLMSG_ERROR = 2
NLM_F_REQUEST = 1
NO_COOKIE = 0xFFFFFFFF  # INET_DIAG_NOCOOKIE: any socket of those addresses
DIAG_TIMEOUT_S = 1.0
UID_OFFSET = 16 + 64  # netlink's header, then inet_diag_msg's idiag_uid
MAPPED = b"\0" * 10 + b"\xff\xff"  # ::ffff:a.b.c.d
_local = threading.local()  # each thread's sock_diag socket (its questions and answers in turn)


def _diag_socket() -> socket.socket:
    diag = getattr(_local, "diag", None)
    if diag is None:
        diag = _local.diag = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG)
        diag.settimeout(DIAG_TIMEOUT_S)
        _local.sequence = itertools.count(1)
    return diag


def _queries(peer: bytes, server: bytes) -> list[tuple[int, bytes, bytes]]:
    """Each (family, local, remote) the peer's socket may have: an IPv4 connection may also be an IPv6 socket
    of IPv4-mapped addresses."""
    if len(peer) == len(server) == 4:
        return [(socket.AF_INET, peer, server), (socket.AF_INET6, MAPPED + peer, MAPPED + server)]
    if len(peer) == len(server) == 16:
        return [(socket.AF_INET6, peer, server)]
    return []


def _diag_uid(diag: socket.socket, family: int, local: tuple[bytes, int], remote: tuple[bytes, int]) -> int | None:
    """The uid of the TCP socket of these addresses, by sock_diag's exact lookup (inet_diag_req_v2, answered
    by one inet_diag_msg, or an error: no such socket); None when there is none."""
    sockid = struct.pack("!HH", local[1], remote[1]) + local[0].ljust(16, b"\0") + remote[0].ljust(16, b"\0")
    sockid += struct.pack("=III", 0, NO_COOKIE, NO_COOKIE)  # any interface, any cookie
    request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid  # every state
    sequence = next(_local.sequence) & 0xFFFFFFFF
    diag.sendto(
        struct.pack("=IHHII", 16 + len(request), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, sequence, 0) + request, (0, 0)
    )
    while True:  # the answer to this question (an earlier one's, late, is passed over)
        answer = diag.recv(1 << 16)
        if len(answer) >= 16 and struct.unpack_from("=I", answer, 8)[0] == sequence:
            break
    if len(answer) < UID_OFFSET + 4 or struct.unpack_from("=H", answer, 4)[0] == NLMSG_ERROR:
        return None
    return int(struct.unpack_from("=I", answer, UID_OFFSET)[0])


def _proc_uid(peer: Address, server: Address, tables: tuple[Path, ...] = TABLES) -> int | None:
    """`peer_uid` from /proc/net/tcp and tcp6: the peer's end is the line whose local address is the peer's,
    its remote port the server's (and its remote address too, unless the server's is the wildcard)."""
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
