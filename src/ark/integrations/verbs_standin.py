"""A stand-in libibverbs and a miniature engine, to test and time the verbs interposer
without RDMA devices.

:func:`build` compiles, once per source, into one folder of ``$ARK_CACHE_DIR``:

* ``libibverbs.so.1``: the STAND-IN (``verbs_standin.c``), NOT a verbs implementation. It
  exports the IBVERBS_1.1 symbols engines link against or dlvsym, and its QP calls only
  record what they were given (read back with :meth:`Engine.records`);
* ``libmlx5.so.1``: a stand-in ``mlx5dv_modify_qp_udp_sport`` with rdma-core's checks;
* ``libarkengine.so`` and ``verbs-engine``: an engine (``verbs_engine.c``) that connects QPs
  as Mooncake and NCCL do, through linked calls or through dlopen + dlvsym, linked against
  the stand-in.

A process using them must start with the folder in ``LD_LIBRARY_PATH`` (:func:`env`): the
stand-in then takes libibverbs.so.1's place for the engine and for the interposer's own
dependency alike. What a real NIC puts on the wire is checked by
``ark testbed roce-check`` on a machine with Soft-RoCE, not here.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ark.integrations import preload
from ark.integrations.preload import PreloadError
from ark.integrations.verbs import CFLAGS, VerbsError, build_error

QPT_RC, QPT_UC, QPT_UD = 2, 3, 4  # enum ibv_qp_type
QPS_INIT, QPS_RTR, QPS_RTS = 1, 2, 3  # enum ibv_qp_state
STANDIN = "libibverbs.so.1"
STANDIN_MLX5 = "libmlx5.so.1"
ENGINE_LIB = "libarkengine.so"
ENGINE_BIN = "verbs-engine"

# After rdma-core's libibverbs.map.in: ibv_modify_qp at IBVERBS_1.0 (compatibility) and at
# IBVERBS_1.1 (the default, which engines link against and NCCL dlvsym()s).
IBVERBS_MAP = b"""IBVERBS_1.0 {
    global: ibv_modify_qp;
};
IBVERBS_1.1 {
    global: ibv_*;
} IBVERBS_1.0;
STANDIN_1 {
    global: standin_*;
    local: *;
};
"""
MLX5_MAP = b"""MLX5_1.17 {
    global: mlx5dv_modify_qp_udp_sport;
};
STANDIN_1 {
    global: standin_*;
    local: *;
};
"""


def _source(name: str) -> bytes:
    return resources.files("ark.integrations").joinpath(name).read_bytes()


def build() -> Path:
    """The folder holding the stand-ins and the engine (compiled on first use)."""
    files = {"standin.c": _source("verbs_standin.c"), "engine.c": _source("verbs_engine.c"),
             "ibverbs.map": IBVERBS_MAP, "mlx5.map": MLX5_MAP}
    link_standin = ["-Lout", f"-l:{STANDIN}", "-ldl", "-lpthread"]
    steps = [
        [*CFLAGS, "-DARK_STANDIN_CORE", "-c", "-o", "core.o", "standin.c"],
        [*CFLAGS, "-DARK_STANDIN_STUBS", "-c", "-o", "stubs.o", "standin.c"],
        ["-shared", f"-Wl,-soname,{STANDIN}", "-Wl,--version-script=ibverbs.map", "-o", f"out/{STANDIN}",
         "core.o", "stubs.o", "-lpthread"],
        [*CFLAGS, "-DARK_STANDIN_MLX5", "-shared", f"-Wl,-soname,{STANDIN_MLX5}", "-Wl,--version-script=mlx5.map",
         "-o", f"out/{STANDIN_MLX5}", "standin.c", "-lpthread"],
        [*CFLAGS, "-shared", "-o", f"out/{ENGINE_LIB}", "engine.c", *link_standin],
        [*CFLAGS, "-DARK_ENGINE_MAIN", "-o", f"out/{ENGINE_BIN}", "engine.c", *link_standin],
    ]
    try:
        return preload.cached_build("ark-verbs-standin", files, steps, suffix="", folder=True)
    except PreloadError as e:
        raise build_error(e) from None


def env(folder: Path, base: Mapping[str, str] | None = None, preload_lib: Path | None = None) -> dict[str, str]:
    """``base`` (default: this process's) with the stand-in folder first in
    ``LD_LIBRARY_PATH``, and ``preload_lib`` (the interposer) first in ``LD_PRELOAD``."""
    out = dict(os.environ if base is None else base)
    out["LD_LIBRARY_PATH"] = ":".join(p for p in (str(folder), out.get("LD_LIBRARY_PATH", "")) if p)
    return preload.preload_env(out, preload_lib) if preload_lib is not None else out


@dataclass(frozen=True)
class Record:
    """One ``ibv_modify_qp`` the stand-in received (``state`` -1: IBV_QP_STATE not in the mask)."""

    qp_num: int
    dest_qp_num: int
    flow_label: int
    mask: int
    state: int
    is_global: bool
    qp_type: int
    dst_ipv4: str | None  # the GID's address when it is IPv4-mapped
    version: str = "IBVERBS_1.1"  # the ibv_modify_qp symbol version that was called


class Engine:
    """The miniature engine and the stand-in's records, in a process started with :func:`env`."""

    def __init__(self, folder: Path) -> None:
        try:
            self.lib = ctypes.CDLL(str(folder / ENGINE_LIB))
        except OSError as e:
            raise VerbsError(f"{ENGINE_LIB}: cannot load ({e}); start the process with verbs_standin.env()") from None
        standin = ctypes.CDLL(STANDIN)  # what the engine linked: the stand-in only if LD_LIBRARY_PATH says so
        if not hasattr(standin, "standin_records"):
            raise VerbsError(f"LD_LIBRARY_PATH: {STANDIN} resolves to the real libibverbs, not {folder}'s stand-in")
        self.standin = standin
        self.folder = folder
        u32p = ctypes.POINTER(ctypes.c_uint32)
        self.lib.eng_connect.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, u32p, ctypes.c_int]
        self.lib.eng_dlvsym_connect.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, u32p,
                                                ctypes.c_char_p, ctypes.c_int]
        self.lib.eng_connect_1_0.argtypes = [ctypes.c_char_p, ctypes.c_int, u32p]
        self.lib.eng_time_rtr.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int64)]
        self.standin.standin_records.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int]

    def connect(self, peer: str, n: int = 1, qp_type: int = QPT_RC, grh: bool = True, keep: bool = False,
                at_rtr: bool = False) -> list[int]:
        """Connect ``n`` QPs to ``peer`` through linked calls; their QP numbers. ``keep``: leave
        them alive in RTS (else destroyed); ``at_rtr``: alive, left in RTR."""
        qpns = (ctypes.c_uint32 * n)()
        rc = self.lib.eng_connect(peer.encode(), qp_type, n, int(grh), qpns, 2 if at_rtr else int(keep))
        if rc != n:
            raise VerbsError(f"eng_connect: {rc} (-2: the caller's attributes were changed)")
        return list(qpns)

    def connect_1_0(self, peer: str, n: int = 1) -> list[int]:
        """Connect ``n`` RC QPs through ``ibv_modify_qp@IBVERBS_1.0``, as a binary linked
        before IBVERBS_1.1 does."""
        qpns = (ctypes.c_uint32 * n)()
        rc = self.lib.eng_connect_1_0(peer.encode(), n, qpns)
        if rc != n:
            raise VerbsError(f"eng_connect_1_0: {rc}")
        return list(qpns)

    def dlvsym_connect(self, lib: str, peer: str, n: int = 1) -> list[int]:
        """Connect ``n`` RC QPs through dlopen(``lib``) + dlvsym, as NCCL does."""
        qpns = (ctypes.c_uint32 * n)()
        missing = ctypes.create_string_buffer(1024)
        rc = self.lib.eng_dlvsym_connect(lib.encode(), peer.encode(), n, qpns, missing, len(missing))
        if rc != n:
            raise VerbsError(f"eng_dlvsym_connect: {rc}; missing: {missing.value.decode()}")
        return list(qpns)

    def time_rtr(self, peer: str, calls: int) -> list[int]:
        """Nanoseconds of each of ``calls`` INIT -> RTR modifies of one RC QP towards ``peer``."""
        ns = (ctypes.c_int64 * calls)()
        if self.lib.eng_time_rtr(peer.encode(), calls, ns) != calls:
            raise VerbsError("eng_time_rtr: a modify failed")
        return list(ns)

    def records(self) -> list[Record]:
        buf = (ctypes.c_int64 * (11 * 65536))()
        n = self.standin.standin_records(buf, 65536)
        out = []
        for i in range(n):
            r = buf[11 * i: 11 * i + 11]
            ip = ".".join(str((r[7] >> s) & 0xFF) for s in (24, 16, 8, 0)) if r[8] else None
            out.append(Record(r[0], r[1], r[2], r[3], r[4], bool(r[5]), r[6], ip, f"IBVERBS_1.{r[9] - 10}"))
        return out

    def rtrs(self) -> list[Record]:
        """The records of calls that moved a QP to RTR."""
        return [r for r in self.records() if r.state == QPS_RTR]

    def reset(self) -> None:
        self.standin.standin_reset()

    def fail_next_rtr(self, rc: int) -> None:
        """The next ``ibv_modify_qp`` to RTR fails with ``rc`` (an errno value)."""
        self.standin.standin_fail_next_rtr(rc)
