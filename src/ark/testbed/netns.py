"""Linux network-namespace plumbing: enter a namespace, set its sysctls, start processes in it.

Python 3.11 has no ``os.setns``; the libc call is one line through ctypes. A namespace
switch applies to the calling *thread* only, so sockets opened inside :func:`inside`
stay bound to that namespace after the thread switches back.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

NETNS_DIR = Path("/run/netns")
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


class NetnsError(OSError):
    """A namespace operation failed."""


def is_root() -> bool:
    return os.geteuid() == 0


def available() -> str | None:
    """Why namespaces cannot be used here, or None when they can."""
    if not is_root():
        return "needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    try:
        import pyroute2  # noqa: F401
    except ImportError:
        return "needs pyroute2 (pip install pyroute2)"
    return None


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise NetnsError(err, f"setns: {os.strerror(err)}")


def path(name: str) -> Path:
    return NETNS_DIR / name


def exists(name: str) -> bool:
    return path(name).exists()


def listed(prefix: str) -> list[str]:
    """Named namespaces whose name starts with ``prefix``."""
    if not NETNS_DIR.is_dir():
        return []
    return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(prefix))


@contextlib.contextmanager
def inside(name: str) -> Iterator[None]:
    """Run the block (this thread only) inside namespace ``name``."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(path(name), os.O_RDONLY)
    except OSError as e:
        os.close(home)
        raise NetnsError(e.errno, f"netns {name}: {e.strerror}") from None
    try:
        _setns(target)
        yield
    finally:
        _setns(home)
        os.close(home)
        os.close(target)


def sysctl(name: str, key: str, value: int | str) -> None:
    """Write ``net.*`` sysctl ``key`` inside namespace ``name``."""
    with inside(name), open("/proc/sys/" + key.replace(".", "/"), "w") as f:
        f.write(str(value))


def read_sysctl(name: str, key: str) -> str:
    with inside(name), open("/proc/sys/" + key.replace(".", "/")) as f:
        return f.read().strip()


def spawn(name: str, argv: Sequence[str], **popen: Any) -> subprocess.Popen[bytes]:
    """Start ``argv`` as a process inside namespace ``name``."""
    target = str(path(name))

    def enter() -> None:  # runs in the child between fork and exec
        fd = os.open(target, os.O_RDONLY)
        _setns(fd)
        os.close(fd)

    return subprocess.Popen(list(argv), preexec_fn=enter, **popen)


def pids_in(names: Sequence[str]) -> list[int]:
    """Processes whose network namespace is one of the named ones."""
    inodes = set()
    for n in names:
        with contextlib.suppress(OSError):
            inodes.add(os.stat(path(n)).st_ino)
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if os.stat(p / "ns" / "net").st_ino in inodes:
                out.append(int(p.name))
        except OSError:
            continue
    return out
