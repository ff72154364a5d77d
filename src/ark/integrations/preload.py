"""The ``connect()`` interposer (``steer.c``): build it, load it, drive it from Python.

A transfer engine opens its TCP connections itself (Mooncake's TCP transport connects
without binding), so ARK cannot hand it a socket. Instead ``libarksteer.so`` is loaded
with the engine's process (``LD_PRELOAD``) and defines ``connect()``: while a thread has
entered a :class:`Rule`, its unbound TCP connects to the rule's peer are bound to the
rule's ports first (ports of the path the transfer reserved). A thread without a rule, or
a process without the library, connects exactly as before.

The library is compiled from the C source shipped in this package, once per source
version, into ``$ARK_CACHE_DIR`` (default ``~/.cache/ark``); :func:`library` builds it if
needed and returns its path, ``ark preload`` prints it or runs a command with it.
"""

from __future__ import annotations

import ctypes
import hashlib
import ipaddress
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple, Self

VERSION = 3
MAX_ENV_RULES = 64
MAX_LANES = 256
MAX_PORTS = 4096
LIB_NAME = "libarksteer"


class Laned(NamedTuple):
    """Ports with their lanes (0..255; the part of a multi-path lease each belongs to):
    connections take the lanes in turn, each on a free port of its own lane first."""

    ports: list[int]
    lanes: list[int]


# resolver(dport, need) -> ports for the rule (the destination port the engine connects to)
Resolver = Callable[[int, int], "list[int] | Laned"]
_RESOLVE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint16, ctypes.c_int)


class PreloadError(RuntimeError):
    """The interposer cannot be built, or is not loaded in this process."""


def source() -> bytes:
    return resources.files("ark.integrations").joinpath("steer.c").read_bytes()


def cache_dir() -> Path:
    return Path(os.environ.get("ARK_CACHE_DIR") or Path.home() / ".cache" / "ark")


def compiler() -> str:
    """The C compiler ($CC, else cc or gcc on PATH)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise PreloadError("CC: no C compiler found (install gcc: scripts/install-mooncake-deps.sh)")
    return cc


BuildSteps = Sequence[Sequence[str]]


def cached_path(stem: str, files: Mapping[str, bytes], steps: BuildSteps, suffix: str = ".so") -> Path:
    """Where :func:`cached_build` puts the product of these files and steps."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + files[name] + b"\0")
    h.update(repr([list(s) for s in steps]).encode())
    return cache_dir() / f"{stem}-{h.hexdigest()[:12]}{suffix}"


def cached_build(stem: str, files: Mapping[str, bytes], steps: BuildSteps, suffix: str = ".so",
                 folder: bool = False) -> Path:
    """Compile once per content: each step (the compiler's arguments) runs in a fresh folder
    holding ``files`` and writes ``out`` (``folder``: products under ``out/``), which lands in
    ``$ARK_CACHE_DIR``."""
    out = cached_path(stem, files, steps, suffix)
    if out.exists():
        return out
    cc = compiler()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        for name, data in files.items():
            (Path(tmp) / name).write_bytes(data)
        if folder:
            (Path(tmp) / "out").mkdir()
        for step in steps:
            res = subprocess.run([cc, *step], cwd=tmp, capture_output=True, text=True, check=False)
            if res.returncode != 0:
                raise PreloadError(f"cc: building {out.name} failed: {res.stderr.strip().splitlines()[-1:]}")
        try:
            (Path(tmp) / "out").replace(out)  # atomic: concurrent builders each rename a complete product
        except OSError:
            if not out.exists():  # a folder cannot replace another builder's: theirs is as good
                raise
    return out


def library(build: bool = True) -> Path:
    """The interposer's shared object for this source (compiled on first use)."""
    files = {"steer.c": source()}
    steps = [["-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-o", "out", "steer.c", "-ldl", "-lpthread"]]
    return cached_build(LIB_NAME, files, steps) if build else cached_path(LIB_NAME, files, steps)


def preload_env(env: dict[str, str] | None = None, lib: Path | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with the interposer first in ``LD_PRELOAD``."""
    env = dict(os.environ if env is None else env)
    path = str(lib or library())
    rest = [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p and p != path]
    env["LD_PRELOAD"] = " ".join([path, *rest])
    return env


class _Lib:
    """The loaded interposer's functions (found through this process's global scope)."""

    def __init__(self) -> None:
        glob = ctypes.CDLL(None)
        try:
            version = glob.ark_steer_version
        except AttributeError:
            raise PreloadError("LD_PRELOAD: the ARK interposer is not loaded in this process; start it with "
                               "`ark preload -- CMD` or LD_PRELOAD=$(ark preload)") from None
        version.restype = ctypes.c_int
        if version() != VERSION:
            raise PreloadError(f"LD_PRELOAD: interposer version {version()} loaded, this ARK needs {VERSION}")
        vp, i, u16p = ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_uint16)
        self.new = glob.ark_steer_new
        self.new.restype, self.new.argtypes = vp, [ctypes.c_uint32, i, i, i, _RESOLVE, vp]
        self.free = glob.ark_steer_free
        self.free.restype, self.free.argtypes = None, [vp]
        self.enter = glob.ark_steer_enter
        self.enter.restype, self.enter.argtypes = None, [vp]
        self.leave = glob.ark_steer_leave
        self.leave.restype, self.leave.argtypes = None, []
        self.add_ports = glob.ark_steer_add_ports
        self.add_ports.restype, self.add_ports.argtypes = i, [vp, u16p, i]
        self.add_lanes = glob.ark_steer_add_lanes
        self.add_lanes.restype, self.add_lanes.argtypes = i, [vp, u16p, ctypes.POINTER(ctypes.c_uint8), i]
        self.set_ports = glob.ark_steer_set_ports
        self.set_ports.restype, self.set_ports.argtypes = None, [vp, u16p, i]
        self.stats = glob.ark_steer_stats
        self.stats.restype, self.stats.argtypes = None, [vp, ctypes.POINTER(ctypes.c_int)]
        self.log = glob.ark_steer_log
        self.log.restype, self.log.argtypes = i, [vp, ctypes.POINTER(ctypes.c_int32), i]
        self.env_rules = glob.ark_steer_env_rules
        self.env_rules.restype, self.env_rules.argtypes = i, []
        self.env_error = glob.ark_steer_env_error
        self.env_error.restype, self.env_error.argtypes = ctypes.c_char_p, []
        self.env_rule = glob.ark_steer_env_rule
        self.env_rule.restype, self.env_rule.argtypes = vp, [i]
        self.env_deferred = glob.ark_steer_env_deferred
        self.env_deferred.restype, self.env_deferred.argtypes = None, [ctypes.POINTER(ctypes.c_int)]
        self.env_lease_stats = glob.ark_steer_env_lease_stats
        self.env_lease_stats.restype, self.env_lease_stats.argtypes = None, [i, ctypes.POINTER(ctypes.c_int)]


_lib: _Lib | None = None


def loaded() -> bool:
    """Whether the interposer is loaded in this process."""
    try:
        require()
    except PreloadError:
        return False
    return True


def require() -> _Lib:
    """The loaded interposer (PreloadError, one line, when it is not loaded)."""
    global _lib
    if _lib is None:
        _lib = _Lib()
    return _lib


def _ports_array(ports: list[int]) -> ctypes.Array[ctypes.c_uint16]:
    for p in ports:
        if isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= 0xFFFF:
            raise ValueError(f"ports: expected integers 1..65535; got {p!r}")
    return (ctypes.c_uint16 * len(ports))(*ports)


@dataclass(frozen=True)
class Connection:
    """One connection a rule saw: its source and destination ports; steered is True (bound
    to a rule port), False (no port was free: it went out unbound) or None (recorded only)."""

    sport: int
    dport: int
    steered: bool | None


@dataclass(frozen=True)
class RuleStats:
    steered: int
    fallback: int
    recorded: int
    resolves: int
    ports: int


_entered = threading.local()  # per thread and library: the rules entered, innermost last


class NativeRule:
    """A rule object of an interposer library (``_lib``: its ``enter``, ``leave`` and
    ``free``; ``_handle``: the C object): entered by ``with`` (nested: the inner rule holds
    until its block ends, then the outer one again), freed once."""

    _lib: Any
    _handle: int | None = None

    def _live(self) -> int:
        if self._handle is None:
            raise ValueError("rule: already closed")
        return self._handle

    def _stack(self) -> list[NativeRule]:
        stacks: dict[int, list[NativeRule]] = _entered.__dict__.setdefault("stacks", {})
        return stacks.setdefault(id(self._lib), [])

    def __enter__(self) -> Self:
        self._lib.enter(self._live())
        self._stack().append(self)
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        stack = self._stack()
        if self in stack:
            stack.reverse()
            stack.remove(self)  # the innermost entry of this rule
            stack.reverse()
        outer = next((r for r in reversed(stack) if r._handle is not None), None)
        if outer is not None:
            self._lib.enter(outer._handle)
        else:
            self._lib.leave()

    def close(self) -> None:
        """Free the C object (the verbs interposer waits for an RTR in flight with it)."""
        if self._handle is not None:
            self._lib.free(self._handle)
            self._handle = None

    def __del__(self) -> None:
        self.close()


class Rule(NativeRule):
    """Connections from the thread that entered this rule, to ``dst_ip`` (any port but
    ``skip_port``): bound to its ports (``steer``) or only recorded.

    ``resolver(dport, need)`` is called from inside the engine's ``connect()`` when the rule
    has no free port, with the destination port and the connections still expected; the
    ports it returns are added (with their lanes when it returns :class:`Laned`). Use as a
    context manager in the thread that calls the engine.
    """

    def __init__(self, dst_ip: str, *, skip_port: int = 0, steer: bool = True, hint: int = 1,
                 resolver: Resolver | None = None) -> None:
        self._handle: int | None = None
        try:
            packed = ipaddress.IPv4Address(dst_ip).packed
        except ValueError:
            raise ValueError(f"dst_ip: expected an IPv4 address; got {dst_ip!r}") from None
        if isinstance(skip_port, bool) or not isinstance(skip_port, int) or not 0 <= skip_port <= 0xFFFF:
            raise ValueError(f"skip_port: expected 0..65535; got {skip_port!r}")
        if isinstance(hint, bool) or not isinstance(hint, int) or not 1 <= hint <= MAX_PORTS:
            raise ValueError(f"hint: expected 1..{MAX_PORTS} connections; got {hint!r}")
        self._lib = require()
        self.resolver = resolver
        self.resolver_error: BaseException | None = None
        self._cb = _RESOLVE(self._resolve)  # kept alive as long as the rule
        # The C side compares with sin_addr.s_addr: the address bytes in network order.
        handle = self._lib.new(int.from_bytes(packed, sys.byteorder), skip_port, int(steer), hint, self._cb if resolver else _RESOLVE(), None)
        if not handle:
            raise MemoryError("ark_steer_new")
        self._handle = handle

    def _resolve(self, _ctx: int | None, dport: int, need: int) -> int:
        if self.resolver is None or self._handle is None:
            return 0
        try:
            got = self.resolver(int(dport), int(need))
            if isinstance(got, Laned):
                return self.add_ports(got.ports, got.lanes) if got.ports else 0
            return self.add_ports(got) if got else 0
        except BaseException as e:  # never unwind through C: the connection falls back
            self.resolver_error = e
            return 0

    def add_ports(self, ports: list[int], lanes: list[int] | None = None) -> int:
        """Append ports (with their lanes, 0..255, one per port); how many the rule took."""
        arr = _ports_array(ports)
        if lanes is None:
            return int(self._lib.add_ports(self._live(), arr, len(ports)))
        if len(lanes) != len(ports) or not all(isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= 255
                                                  for k in lanes):
            raise ValueError(f"lanes: expected one integer 0..255 per port; got {lanes!r:.80}")
        return int(self._lib.add_lanes(self._live(), arr, (ctypes.c_uint8 * len(lanes))(*lanes), len(ports)))

    def set_ports(self, ports: list[int]) -> None:
        arr = _ports_array(ports)
        self._lib.set_ports(self._live(), arr, len(ports))

    def stats(self) -> RuleStats:
        out = (ctypes.c_int * 5)()
        self._lib.stats(self._live(), out)
        return RuleStats(*out)

    def connections(self) -> list[Connection]:
        buf = (ctypes.c_int32 * (3 * MAX_PORTS))()
        n = self._lib.log(self._live(), buf, MAX_PORTS)
        return [Connection(buf[3 * i], buf[3 * i + 1], None if buf[3 * i + 2] < 0 else bool(buf[3 * i + 2]))
                for i in range(n)]



# ---------------------------------------------------------------------------- process-wide rules
class SteerRulesError(ValueError):
    """An ``ARK_STEER_RULES`` value that the interposer would refuse (one line, naming the rule)."""


@dataclass(frozen=True)
class EnvRule:
    """A process-wide rule: connections to ``dst_ip`` (on ``dport``; 0: any port) from any
    thread without a rule of its own take the ports of ``paths`` in turn, one path per new
    connection (path k: lane k), so that one peer pair's connections sit on distinct paths;
    or, with ``lease`` (the unix socket of a connection-lease holder,
    :mod:`ark.integrations.connlease`), each takes the ports of a lease of its own."""

    dst_ip: str
    paths: tuple[tuple[int, ...], ...] = ()
    dport: int = 0
    lease: str = ""

    def text(self) -> str:
        dst = self.dst_ip if not self.dport else f"{self.dst_ip}:{self.dport}"
        if self.lease:
            return f"{dst}=lease:{self.lease}"
        return f"{dst}=ports:" + "/".join(",".join(str(p) for p in lane) for lane in self.paths)


def _check_rule(i: int, r: EnvRule) -> None:
    where = f"ARK_STEER_RULES: rule {i + 1}"
    try:
        ipaddress.IPv4Address(r.dst_ip)
    except ValueError:
        raise SteerRulesError(f"{where}: destination: expected an IPv4 address; got {r.dst_ip!r:.40}") from None
    if isinstance(r.dport, bool) or not isinstance(r.dport, int) or not 0 <= r.dport <= 0xFFFF:
        raise SteerRulesError(f"{where}: dport: expected 0..65535 (0: any); got {r.dport!r:.40}")
    if r.lease:
        if r.paths or not r.lease.startswith("/") or len(r.lease.encode()) >= 108 or any(c in r.lease for c in ";\n"):
            raise SteerRulesError(f"{where}: lease: expected an absolute socket path under 108 bytes and no paths")
        return
    if not r.paths or len(r.paths) > MAX_LANES or not all(r.paths):
        raise SteerRulesError(f"{where}: paths: expected 1..{MAX_LANES} non-empty port groups")
    ports = [p for lane in r.paths for p in lane]
    if len(ports) > MAX_PORTS:
        raise SteerRulesError(f"{where}: ports: at most {MAX_PORTS} per rule; got {len(ports)}")
    try:
        _ports_array(ports)
    except ValueError as e:
        raise SteerRulesError(f"{where}: {e}") from None


def steer_rules(rules: Sequence[EnvRule]) -> str:
    """The ``ARK_STEER_RULES`` value for ``rules``, checked as the interposer checks it."""
    if not rules or len(rules) > MAX_ENV_RULES:
        raise SteerRulesError(f"ARK_STEER_RULES: expected 1..{MAX_ENV_RULES} rules; got {len(rules)}")
    seen: set[tuple[str, int]] = set()
    for i, r in enumerate(rules):
        _check_rule(i, r)
        if (r.dst_ip, r.dport) in seen:
            raise SteerRulesError(f"ARK_STEER_RULES: rule {i + 1}: a second rule for this destination")
        seen.add((r.dst_ip, r.dport))
    return ";".join(r.text() for r in rules)


@dataclass(frozen=True)
class EnvStatus:
    """What the loaded interposer made of ``ARK_STEER_RULES``: rules loaded, the refusal (empty
    when none), binds deferred to connect() and how many of those a steered port took, and per
    rule the connections it saw."""

    rules: int
    error: str
    deferred: int
    deferred_steered: int
    connections: tuple[tuple[Connection, ...], ...]  # empty for a lease rule
    leases: tuple[tuple[int, int, int], ...]  # per rule: (asked, steered, fallback); zeros for a ports rule


def env_status() -> EnvStatus:
    """The process-wide rules of the interposer loaded in this process."""
    lib = require()
    n = int(lib.env_rules())
    out = (ctypes.c_int * 2)()
    lib.env_deferred(out)
    conns, leases = [], []
    buf = (ctypes.c_int32 * (3 * MAX_PORTS))()
    three = (ctypes.c_int * 3)()
    for i in range(n):
        handle = lib.env_rule(i)
        got = lib.log(handle, buf, MAX_PORTS) if handle else 0
        conns.append(tuple(Connection(buf[3 * k], buf[3 * k + 1], None if buf[3 * k + 2] < 0 else bool(buf[3 * k + 2]))
                           for k in range(got)))
        lib.env_lease_stats(i, three)
        leases.append((int(three[0]), int(three[1]), int(three[2])))
    return EnvStatus(n, (lib.env_error() or b"").decode(), int(out[0]), int(out[1]), tuple(conns), tuple(leases))
