"""The agent's sockets, configured for a hostile network and hostile local users.

* Every inbound socket caps message size (``ZMQ_MAXMSGSIZE``): a frame announcing more is
  refused before anything is allocated, during the CURVE handshake too.
* The control socket gives an unauthenticated connection ``HANDSHAKE_IVL_MS`` to finish
  its handshake, and a :class:`ConnectionGuard` keeps the number of connections within a
  budget: each connection the listener accepts beyond it is shut down at once (listed
  peers reconnect by themselves), so strangers cannot use up the descriptors.
* The local API lives in a directory that must belong to this user and be writable by
  nobody else; otherwise another user could replace the socket and hand an engine a
  forged lease. A socket file already there is removed only when nothing accepts
  connections on it: a second agent never takes over a live agent's API.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import cast

import zmq
from zmq.utils.monitor import parse_monitor_message

from ark.agent.cluster import read_secret_key

HANDSHAKE_IVL_MS = 2000
STRANGERS = 64  # connections at once from addresses no listed host has
_POLLIN = int(zmq.POLLIN)


class AgentError(RuntimeError):
    """The agent cannot start as configured (one line naming what and why)."""


def raise_fd_limit() -> int:
    """Lift the soft descriptor limit to the hard one; returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return int(soft) if soft != resource.RLIM_INFINITY else 1 << 20


def check_resolvable(endpoint: str, field: str) -> None:
    """A ``tcp://HOST:PORT`` whose host does not resolve is a one-line error, not a traceback."""
    if not endpoint.startswith("tcp://"):
        return
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    try:
        socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except (socket.gaierror, ValueError, UnicodeError) as e:
        raise AgentError(f"{field}: cannot resolve {endpoint} ({e}); expected tcp://HOST:PORT with a HOST that "
                         f"resolves here") from None


def private_api_dir(endpoint: str) -> None:
    """Create the API socket's directory (0700), or refuse one that others could write to."""
    if not endpoint.startswith("ipc://"):
        return
    path = Path(endpoint[len("ipc://"):])
    d = path.parent
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(d)
    except OSError as e:
        raise AgentError(f"api: cannot create {d} ({e.strerror}); expected a directory this user can create or own") from None
    if st.st_uid != os.geteuid():
        raise AgentError(f"api: {d} belongs to uid {st.st_uid}, not to this user ({os.geteuid()}); refusing to use it")
    if st.st_mode & 0o022:
        raise AgentError(f"api: {d} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); "
                         f"make it 0700 or 0755")
    if not os.access(d, os.W_OK | os.X_OK):
        raise AgentError(f"api: {d} is not writable by this user ({os.geteuid()}); expected a directory it can write")
    with contextlib.suppress(FileNotFoundError):
        sst = os.lstat(path)
        if not stat.S_ISSOCK(sst.st_mode) or sst.st_uid != os.geteuid():
            raise AgentError(f"api: {path} exists and is not this user's socket; refusing to replace it")
        # Whatever the spelling (a doubled slash, a symlinked directory, a relative path),
        # the socket file is the same: ask it, never the path, whether someone is behind it.
        if _served(path):
            raise AgentError(f"api: {endpoint} is served by another running agent (it accepts connections; "
                             f"real path {os.path.realpath(path)}); stop that agent or give this host another api")
        path.unlink()  # a stale socket from a killed predecessor


def _served(path: Path) -> bool:
    """Whether something accepts connections on the Unix socket at ``path``."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        return False  # nobody listens: a stale file
    except OSError as e:  # a full backlog, a timeout, a path too long: not ours to remove
        raise AgentError(f"api: cannot tell whether an agent serves {path} ({e}); remove it if none does") from None
    finally:
        s.close()
    return True


def bind(sock: zmq.Socket, endpoint: str, field: str) -> None:
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        raise AgentError(f"{field}: cannot bind {endpoint}: {e.strerror}; expected an address of this host "
                         f"that nothing else holds") from None


def ipc_identity(endpoint: str) -> tuple[int, int] | None:
    """(device, inode) of an ipc endpoint's socket file: what :func:`remove_ipc` checks."""
    if endpoint.startswith("ipc://"):
        with contextlib.suppress(OSError):
            st = os.stat(endpoint[len("ipc://"):])
            return st.st_dev, st.st_ino
    return None


def remove_ipc(endpoint: str, identity: tuple[int, int] | None) -> None:
    """Remove our socket file at shutdown, unless it is no longer ours (replaced since)."""
    if identity is not None and ipc_identity(endpoint) == identity:
        with contextlib.suppress(OSError):
            os.unlink(endpoint[len("ipc://"):])


def open_api(ctx: zmq.Context, endpoint: str, max_bytes: int) -> zmq.Socket:
    private_api_dir(endpoint)
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    old = os.umask(0o077)  # the local API is for this host's own users only
    try:
        bind(sock, endpoint, "api")
    except AgentError:
        sock.close(0)
        raise
    finally:
        os.umask(old)
    return sock


class ConnectionGuard:
    """Watches the control socket's connections and sheds those beyond the budget.

    Connections from addresses no listed host has ("strangers") share a small budget of
    their own (:data:`STRANGERS`), so they cannot crowd out the peers' reconnections.
    """

    def __init__(self, sock: zmq.Socket, budget: int, listed_ips: set[str]) -> None:
        self.monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.budget, self.listed_ips = budget, listed_ips
        self.open: dict[int, bool] = {}  # fd -> a stranger's
        self.shed = 0

    def events(self, limit: int = 4096) -> Iterator[tuple[int, int]]:
        """The monitor's waiting (event, descriptor) pairs, at most ``limit``."""
        for _ in range(limit):
            if not int(self.monitor.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                return
            ev = parse_monitor_message(self.monitor.recv_multipart())
            yield int(ev["event"]), int(ev["value"])

    def drain(self, limit: int = 4096) -> None:
        for event, fd in self.events(limit):
            if event == zmq.EVENT_DISCONNECTED:
                self.open.pop(fd, None)
                continue
            stranger = _peer_ip(fd) not in self.listed_ips
            strangers = sum(self.open.values())
            if len(self.open) >= self.budget or (stranger and strangers >= STRANGERS):
                self._shed(fd)
            else:
                self.open[fd] = stranger

    def _shed(self, fd: int) -> None:
        # Our own descriptor for the same connection: shutting it down makes libzmq see
        # the peer gone and close its own, freeing the descriptor.
        with contextlib.suppress(OSError):
            s = socket.socket(fileno=os.dup(fd))
            try:
                s.shutdown(socket.SHUT_RDWR)
            finally:
                s.close()
            self.shed += 1

    def close(self) -> None:
        self.monitor.close(0)


def _peer_ip(fd: int) -> str | None:
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        return str(s.getpeername()[0])
    except (OSError, IndexError):
        return None
    finally:
        s.close()


class ZapKeys:
    """ZAP credentials provider: only the listed public keys get in."""

    def __init__(self, keys: Iterable[str]) -> None:
        self.keys = {k.encode() for k in keys}

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


def endpoint_ips(endpoints: Iterable[str]) -> set[str]:
    """The addresses of the ``tcp://`` endpoints (the listed hosts' and arbiters')."""
    ips: set[str] = set()
    for ep in endpoints:
        if ep.startswith("tcp://"):
            host = ep[len("tcp://"):].rpartition(":")[0].strip("[]")
            with contextlib.suppress(OSError):
                ips.update(str(a[4][0]) for a in socket.getaddrinfo(host, None))
    return ips


def own_curve_keys(keyfile: str | None, public_key: str, name: str, table: str) -> tuple[bytes, bytes]:
    """(public, secret) of this process from ``keyfile``, which must hold the secret key of
    the ``public_key`` the cluster file lists for ``name`` (in its ``table``)."""
    if keyfile is None:
        raise AgentError(f"secret_key_file: not set for {name}; give --secret-key or set secret_key_file "
                         f"in its {table} table")
    pub, secret = read_secret_key(keyfile)
    if pub.decode() != public_key:
        raise AgentError(f"secret_key_file: {keyfile} does not match {name}'s public_key in the cluster file; "
                         f"expected the secret key of that public key (ark keygen wrote both)")
    return pub, secret


def readable(sock: zmq.Socket) -> bool:
    # A plain integer query: a receive that fails costs a raised exception, several times more.
    return bool(cast(int, sock.getsockopt(zmq.EVENTS)) & _POLLIN)


def recv_frames(sock: zmq.Socket, keep: int = 3) -> list[zmq.Frame]:
    """One multipart message without a socket query per part; only its first ``keep``
    parts are kept (a peer that sends more is invalid anyway, and cannot make us hold them)."""
    f = sock.recv(copy=False)
    frames = [f]
    while f.more:
        f = sock.recv(copy=False)
        if len(frames) < keep:
            frames.append(f)
    return frames
