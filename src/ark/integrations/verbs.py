"""The verbs interposer (``verbs.c``): RoCEv2 QPs of unmodified RDMA engines on leased paths.

A RoCEv2 QP's UDP source port follows from the GRH flow label it is given at INIT -> RTR
(:mod:`ark.core.roce`). ``libarkverbs.so`` defines ``ibv_modify_qp`` with libibverbs'
version (IBVERBS_1.1) and, for the RTRs towards a peer that a :class:`QpRule` names, sets the
flow label of the rule's next port. It reaches an engine in one of two ways:

* ``LD_PRELOAD`` (:func:`preload_env`): engines that link libibverbs and call
  ``ibv_modify_qp`` through the dynamic linker (Mooncake, UCX's verbs-connected QPs,
  librdmacm users, NCCL built with ``NCCL_BUILD_RDMA_CORE``);
* ``NCCL_IBVERBS_LIB`` (:func:`nccl_env`): NCCL dlopen()s the library it names and
  dlvsym()s every verbs function from that handle, which ``LD_PRELOAD`` cannot reach; the
  interposer depends on libibverbs.so.1, so its handle resolves every other function there.

Rules come from Python (this module: a thread's rule, :meth:`QpRule.__enter__`, or one for
the whole process, :meth:`QpRule.install`) or from the environment (:func:`rules_env`,
``ARK_VERBS_RULES``) for a process that runs no ARK code. Engines connect their QPs on their
own threads (NCCL's proxy thread, Mooncake's transfer workers), so for them the rule must be
installed for the process. A QP is steered once, when it connects: engines that keep their
QPs across transfers keep them on that path unless :meth:`QpRule.repath` moves them
(``mlx5dv_modify_qp_udp_sport``: mlx5 only). ``docs/engines/roce.md`` says which engine
takes which route.

Loaded from Python (``require``) without ``LD_PRELOAD``, the library interposes nothing that
is linked: its rules then serve only an engine that dlopen()s it by path (NCCL).
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from ark.agent.client import ArkClient, HeldLease, HeldSplit
from ark.core.node import Lease
from ark.core.roce import ROCE_SPORT_MAX, ROCE_SPORT_MIN
from ark.integrations import preload
from ark.integrations.preload import Laned, NativeRule, PreloadError

VERSION = 1
LIB_NAME = "libarkverbs"
MAX_LOG = 4096
RULES_ENV = "ARK_VERBS_RULES"
LOG_ENV = "ARK_VERBS_LOG"
NCCL_ENV = "NCCL_IBVERBS_LIB"
# ark_verbs_repath's own results (besides 0 and the errno mlx5dv_modify_qp_udp_sport returns)
NO_MLX5DV, NO_QP, BAD_PORT = -1, -2, -3

# ibv_modify_qp and ibv_destroy_qp at libibverbs' version, so that they interpose the
# engine's versioned references; ARK's own functions; nothing else exported.
VERSION_SCRIPT = b"""IBVERBS_1.1 {
    global: ibv_modify_qp; ibv_destroy_qp;
};
ARK_VERBS_1 {
    global: ark_verbs_*;
    local: *;
};
"""
CFLAGS = ["-O2", "-Wall", "-Wextra", "-Werror", "-fPIC"]


class VerbsError(RuntimeError):
    """The verbs interposer cannot be built or loaded, or a rule is asked something wrong."""


def source() -> bytes:
    return resources.files("ark.integrations").joinpath("verbs.c").read_bytes()


def build_error(e: PreloadError) -> VerbsError:
    """The build's failure in the words of what to install."""
    text = str(e)
    if "infiniband/verbs.h" in text:
        return VerbsError("infiniband/verbs.h: not found; install libibverbs-dev (scripts/install-mooncake-deps.sh)")
    if "libibverbs.so.1" in text:
        return VerbsError("libibverbs.so.1: not found; install libibverbs1 (scripts/install-mooncake-deps.sh)")
    return VerbsError(text)


def library(build: bool = True) -> Path:
    """``libarkverbs.so`` for this source (compiled on first use into ``$ARK_CACHE_DIR``)."""
    files = {"verbs.c": source(), "verbs.map": VERSION_SCRIPT}
    # --no-as-needed: nothing here calls libibverbs directly, yet it must be a dependency
    # (NCCL's dlvsym through this library's handle finds every other function there).
    steps = [[*CFLAGS, "-shared", "-Wl,--version-script=verbs.map", "-o", "out", "verbs.c", "-Wl,--no-as-needed",
              "-l:libibverbs.so.1", "-ldl", "-lpthread"]]
    if not build:
        return preload.cached_path(LIB_NAME, files, steps)
    try:
        return preload.cached_build(LIB_NAME, files, steps)
    except PreloadError as e:
        raise build_error(e) from None


def preload_env(env: Mapping[str, str] | None = None, lib: Path | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with the interposer first in ``LD_PRELOAD``."""
    return preload.preload_env(dict(os.environ if env is None else env), lib or library())


def nccl_env(env: Mapping[str, str] | None = None, lib: Path | None = None) -> dict[str, str]:
    """``env`` with ``NCCL_IBVERBS_LIB`` naming the interposer: NCCL loads verbs through it."""
    out = dict(os.environ if env is None else env)
    out[NCCL_ENV] = str(lib or library())
    return out


def peer_gid(peer: str) -> bytes:
    """The 16-byte destination GID of ``peer``'s RoCEv2 packets: IPv4 as ``::ffff:a.b.c.d``."""
    try:
        addr = ipaddress.ip_address(peer)
    except ValueError:
        raise ValueError(f"peer: expected an IPv4 or IPv6 address; got {peer!r}") from None
    if isinstance(addr, ipaddress.IPv4Address):
        return bytes(10) + b"\xff\xff" + addr.packed
    return addr.packed


def _check_ports(ports: Sequence[int], lanes: Sequence[int] | None) -> None:
    for p in ports:
        if isinstance(p, bool) or not isinstance(p, int) or not ROCE_SPORT_MIN <= p <= ROCE_SPORT_MAX:
            raise ValueError(f"ports: expected integers {ROCE_SPORT_MIN}..{ROCE_SPORT_MAX} (what a RoCEv2 flow label "
                             f"reaches); got {p!r}")
    if lanes is not None and (len(lanes) != len(ports) or not all(
            isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= 255 for k in lanes)):
        raise ValueError(f"lanes: expected one integer 0..255 per port; got {list(lanes)!r:.80}")


def rules_env(rules: Mapping[str, Sequence[int] | Laned]) -> str:
    """The ``ARK_VERBS_RULES`` value installing one process rule per peer at load time."""
    parts = []
    for peer, ports in rules.items():
        peer_gid(peer)
        plist, lanes = (ports.ports, ports.lanes) if isinstance(ports, Laned) else (list(ports), None)
        _check_ports(plist, lanes)
        items = [str(p) if lanes is None else f"{p}/{k}" for p, k in zip(plist, lanes or plist, strict=True)]
        parts.append(f"{peer}={','.join(items)}")
    return ";".join(parts)


def lease_ports(leases: Sequence[Lease]) -> Laned:
    """The ports of a (multi-path) lease's reserved parts, part k in lane k: QPs then take
    the parts in turn. Parts that reserved nothing give none (their QPs keep the kernel's
    port, plain ECMP)."""
    reserved = [le for le in leases if le.reserved]
    for le in reserved:
        if le.flow_label is None:
            raise VerbsError(f"lease.src_port: {le.src_port} is outside {ROCE_SPORT_MIN}-{ROCE_SPORT_MAX}, which no "
                             "flow label reaches; give the cluster a port_range inside it")
    return Laned([le.src_port for le in reserved], list(range(len(reserved))))


class _Lib:
    """The interposer's functions in this process (``ark_verbs_<name>``)."""

    new: Any
    free: Any
    enter: Any
    leave: Any
    install: Any
    uninstall: Any
    add_lanes: Any
    set_lanes: Any
    log_to: Any
    stats: Any
    log: Any
    repath: Any
    can_repath: Any
    flow_label: Any

    def __init__(self, handle: ctypes.CDLL) -> None:
        version = handle.ark_verbs_version
        version.restype = ctypes.c_int
        if version() != VERSION:
            raise VerbsError(f"{LIB_NAME}: version {version()} loaded, this ARK needs {VERSION}")
        vp, i, u16p, u8p = ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_uint16), ctypes.POINTER(ctypes.c_uint8)
        sig = {"new": (vp, [ctypes.c_char_p, i]), "free": (None, [vp]), "enter": (None, [vp]), "leave": (None, []),
               "install": (i, [vp]), "uninstall": (None, [vp]), "add_lanes": (i, [vp, u16p, u8p, i]),
               "set_lanes": (i, [vp, u16p, u8p, i]), "log_to": (i, [vp, ctypes.c_char_p]),
               "stats": (None, [vp, ctypes.POINTER(i)]), "log": (i, [vp, ctypes.POINTER(ctypes.c_int64), i]),
               "repath": (i, [vp, ctypes.c_uint32, i]), "can_repath": (i, []), "flow_label": (ctypes.c_uint32, [i])}
        for name, (res, args) in sig.items():
            f = getattr(handle, f"ark_verbs_{name}")
            f.restype, f.argtypes = res, args
            setattr(self, name, f)


_lib: _Lib | None = None


def _open() -> ctypes.CDLL:
    glob = ctypes.CDLL(None)
    if hasattr(glob, "ark_verbs_version"):  # preloaded: the engine's interposer itself
        return glob
    named = os.environ.get(NCCL_ENV, "")
    # The file NCCL_IBVERBS_LIB names, when it is an ARK interposer: one instance, one set of rules.
    path = Path(named) if Path(named).name.startswith(LIB_NAME) and Path(named).is_file() else library()
    try:
        return ctypes.CDLL(str(path), mode=os.RTLD_NOW)
    except OSError as e:
        raise VerbsError(f"{LIB_NAME}: cannot load {path}: {e}") from None


def require() -> _Lib:
    """The interposer in this process: the preloaded one, else loaded now."""
    global _lib
    if _lib is None:
        _lib = _Lib(_open())
    return _lib


def can_repath() -> bool:
    """Whether ``mlx5dv_modify_qp_udp_sport`` is in this process (live re-paths possible)."""
    return bool(require().can_repath())


def flow_label(port: int) -> int:
    """The flow label the interposer sets for ``port`` (0: outside 0xC000..0xFFFF)."""
    if isinstance(port, bool) or not isinstance(port, int) or not -(1 << 31) <= port < 1 << 31:
        raise ValueError(f"port: expected an integer 0..65535; got {port!r}")  # ctypes would truncate it
    return int(require().flow_label(port))


@dataclass(frozen=True)
class QpRecord:
    """One QP a rule saw connect (INIT -> RTR). ``steered``: True, the rule set its flow label
    (``port`` is the lease's); False, the rule had no port left; None, recorded only; in both
    of the latter, ``port`` is the one the kernel derives (label 0: from the QP numbers)."""

    qp_num: int
    dest_qp_num: int
    port: int
    flow_label: int
    lane: int | None
    steered: bool | None
    repathed: bool
    alive: bool  # False once the engine destroyed the QP


@dataclass(frozen=True)
class QpRuleStats:
    steered: int
    no_port: int
    recorded: int
    repaths: int
    ports: int


@dataclass(frozen=True)
class Repath:
    """What :meth:`QpRule.repath` did: ``moved``, or why the QP keeps its path."""

    qp_num: int
    port: int
    moved: bool
    why: str = ""


def _repath_why(rc: int) -> str:
    if rc == NO_MLX5DV:
        return "mlx5dv_modify_qp_udp_sport: not available in this process (rdma-core 33+ with an mlx5 NIC)"
    if rc == NO_QP:
        return "qp_num: no live QP of this rule has it"
    if rc == BAD_PORT:
        return "port: expected 1..65535"
    return f"mlx5dv_modify_qp_udp_sport: {os.strerror(rc)} (needs an RC/UC QP in RTS and rts2rts_qp_udp_sport)"


class QpRule(NativeRule):
    """The RTRs towards ``peer`` (an IPv4 or IPv6 address: the GRH's destination GID) of the
    thread that entered this rule (``with rule:``) or, once :meth:`install`\\ ed, of every
    thread: each gets the flow label of the rule's next port (``steer``), or is only
    recorded with the port the kernel derives."""

    def __init__(self, peer: str, *, steer: bool = True, log_path: str | None = None) -> None:
        self._handle: int | None = None
        gid = peer_gid(peer)
        self.peer = peer
        self._lib = require()
        handle = self._lib.new(gid, int(steer))
        if not handle:
            raise MemoryError("ark_verbs_new")
        self._handle = handle
        if log_path is not None and self._lib.log_to(handle, log_path.encode()) != 0:
            raise VerbsError(f"log_path: cannot open {log_path} (a regular file, not a link, FIFO or device)")

    @classmethod
    def for_lease(cls, peer: str, leases: Sequence[Lease], log_path: str | None = None) -> QpRule:
        """A steering rule with the ports of a lease's reserved parts (part k: lane k)."""
        rule = cls(peer, log_path=log_path)
        laned = lease_ports(leases)
        if laned.ports:
            rule.add_ports(laned.ports, laned.lanes)
        return rule

    def _arrays(self, ports: Sequence[int], lanes: Sequence[int] | None) -> tuple[ctypes.Array[ctypes.c_uint16],
                                                                               ctypes.Array[ctypes.c_uint8] | None]:
        _check_ports(ports, lanes)
        return (ctypes.c_uint16 * len(ports))(*ports), None if lanes is None else (ctypes.c_uint8 * len(lanes))(*lanes)

    def add_ports(self, ports: Sequence[int], lanes: Sequence[int] | None = None) -> int:
        """Append ports (0xC000..0xFFFF) with their lanes (0..255); how many the rule took."""
        arr, lan = self._arrays(ports, lanes)
        return int(self._lib.add_lanes(self._live(), arr, lan, len(ports)))

    def set_ports(self, ports: Sequence[int], lanes: Sequence[int] | None = None) -> int:
        """Replace the ports (a re-pathed lease): QPs that connect later take the new ones."""
        arr, lan = self._arrays(ports, lanes)
        return int(self._lib.set_lanes(self._live(), arr, lan, len(ports)))

    def install(self) -> None:
        """Apply to every thread's RTRs towards the peer (engines connect on their own threads)."""
        if self._lib.install(self._live()) != 0:
            raise VerbsError("install: 64 rules are installed already; uninstall or close one")

    def uninstall(self) -> None:
        self._lib.uninstall(self._live())

    @contextlib.contextmanager
    def installed(self) -> Iterator[QpRule]:
        self.install()
        try:
            yield self
        finally:
            self.uninstall()

    def stats(self) -> QpRuleStats:
        out = (ctypes.c_int * 5)()
        self._lib.stats(self._live(), out)
        return QpRuleStats(*out)

    def qps(self) -> list[QpRecord]:
        buf = (ctypes.c_int64 * (7 * MAX_LOG))()
        n = self._lib.log(self._live(), buf, MAX_LOG)
        rows = [buf[7 * i: 7 * i + 7] for i in range(n)]
        return [QpRecord(int(q), int(d), int(p), int(fl), None if lane < 0 else int(lane),
                         {1: True, 0: False}.get(int(kind)), rep == 1, rep != 2)
                for q, d, p, fl, lane, kind, rep in rows]

    def repath(self, qp_num: int, port: int) -> Repath:
        """Move a live QP this rule steered to ``port`` (mlx5, QP in RTS); else it keeps its path."""
        # ctypes truncates out-of-range integers silently: 2**32 + 60001 would become 60001.
        if isinstance(qp_num, bool) or not isinstance(qp_num, int) or not 0 <= qp_num <= 0xFFFFFFFF:
            raise ValueError(f"qp_num: expected an integer 0..{0xFFFFFFFF}; got {qp_num!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not -(1 << 31) <= port < 1 << 31:
            raise ValueError(f"port: expected an integer 1..65535; got {port!r}")
        rc = int(self._lib.repath(self._live(), qp_num, port))
        return Repath(qp_num, port, rc == 0, "" if rc == 0 else _repath_why(rc))



@dataclass
class QpLease:
    """A lease whose reserved parts steer this process's QPs towards ``peer`` (see
    :func:`lease_qps`). ``moved``: live QPs re-pathed after the agent moved their part;
    ``kept``: live QPs that stay on their old path, and why (no mlx5dv, no capability,
    the part holds no path any more)."""

    held: HeldLease
    rule: QpRule
    moved: list[Repath] = field(default_factory=list)
    kept: list[Repath] = field(default_factory=list)
    _now: list[tuple[bool, int]] = field(default_factory=list)  # per part: (reserved, path) as the rule has it
    _given: list[tuple[bool, int]] = field(default_factory=list)  # per part: what held.ports were handed for
    _mu: threading.Lock = field(default_factory=threading.Lock)

    @property
    def parts(self) -> list[Lease]:
        return list(self.held.parts) if isinstance(self.held, HeldSplit) else [self.held.current]

    def qps(self) -> list[QpRecord]:
        return self.rule.qps()

    def lanes(self) -> Laned:
        """Part k's ports in lane k: its ports for the expected QPs (``held.ports``), or its
        source port once the agent re-pathed it; parts holding no path give none."""
        ports: list[int] = []
        lanes: list[int] = []
        for k, le in enumerate(self.parts):
            if not le.reserved:
                continue
            given = self.held.ports[k] if k < len(self.held.ports) else []
            fresh = k < len(self._given) and self._given[k] == (True, le.path)
            own = given if fresh and given else [le.src_port]
            ports += own
            lanes += [k] * len(own)
        bad = [p for p in ports if not ROCE_SPORT_MIN <= p <= ROCE_SPORT_MAX]
        if bad:
            raise VerbsError(f"lease ports: {bad[:4]} outside {ROCE_SPORT_MIN}-{ROCE_SPORT_MAX}, which no flow label "
                             "reaches; give the cluster a port_range inside it")
        return Laned(ports, lanes)

    def follow(self, held: HeldLease) -> None:
        """After a renewal: a part the agent moved to another path gives later QPs its new
        port, and its live QPs are moved there when mlx5dv can; otherwise they keep their
        path, listed in ``kept`` with why."""
        with self._mu:
            if self.rule._handle is None:  # the block has ended
                return
            parts = self.parts
            changed = {k for k, le in enumerate(parts) if (le.reserved, le.path) != self._now[k]}
            if not changed:
                return
            laned = self.lanes()
            self.rule.set_ports(laned.ports, laned.lanes)
            self._now = [(le.reserved, le.path) for le in parts]
            for q in self.rule.qps():
                k = 0 if q.lane is None else q.lane
                if not (q.alive and q.steered and k in changed):
                    continue
                le = parts[k]
                r = (self.rule.repath(q.qp_num, le.src_port) if le.reserved else
                     Repath(q.qp_num, q.port, False, f"part {k}: holds no path now ({le.fallback or 'unreserved'})"))
                (self.moved if r.moved else self.kept).append(r)


@contextlib.contextmanager
def lease_qps(client: ArkClient, dst: str | int, peer: str, nbytes: int, *, parts: int | None = None, qps: int = 0,
              dport: int = 4791, install: bool = True, log_path: str | None = None) -> Iterator[QpLease]:
    """A lease towards ``dst`` (its RoCE address ``peer``) whose reserved parts steer the QPs
    this process connects to ``peer`` while the block runs: QP i takes part i mod parts
    (``parts``: a multi-path lease; None: one path), each on a port of its part's path
    (``qps``: the QPs expected, so that each gets its own port). ``install``: every thread's
    QPs (engines connect on their own threads); False: only this thread's. The lease is
    renewed in the background and followed when the agent re-paths a part
    (:meth:`QpLease.follow`); at exit the rule is removed and the lease released.

    Only QPs that connect inside the block are steered; a QP connected earlier and kept by
    the engine stays where it is unless a re-path moves it (mlx5)."""
    box: list[QpLease] = []

    def on_renew(held: HeldLease) -> None:
        if box:
            box[0].follow(held)

    with client.lease(dst, nbytes, dport=dport, parts=parts, connections=qps, on_renew=on_renew) as held:
        rule = QpRule(peer, log_path=log_path)
        ql = QpLease(held, rule)
        try:
            ql._now = [(le.reserved, le.path) for le in ql.parts]
            ql._given = list(ql._now)
            laned = ql.lanes()
            if laned.ports:
                rule.add_ports(laned.ports, laned.lanes)
            box.append(ql)
            with rule.installed() if install else rule:
                yield ql
        finally:
            box.clear()
            with ql._mu:  # a renewal following a re-path finishes first
                rule.close()
