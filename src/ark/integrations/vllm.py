"""vLLM's Mooncake KV connector with ARK: each KV push of a prefill instance on leased paths.

Start each vLLM instance under the ``connect()`` interposer (``ark preload -- vllm serve
...``) with this module as its connector::

    --kv-transfer-config '{"kv_connector": "ArkMooncakeConnector",
                           "kv_connector_module_path": "ark.integrations.vllm",
                           "kv_role": "kv_producer", "engine_id": "prefill0",
                           "kv_connector_extra_config": {"mooncake_protocol": "tcp",
                               "ark_cluster": "/etc/ark/cluster.toml", "ark_host": "gpu0",
                               "ark_parts": 0}}'

:class:`ArkMooncakeConnector` is vLLM's ``MooncakeConnector`` (the prefill side pushes each
request's KV blocks with its transfer engine's ``batch_transfer_sync_write``, one request per
contiguous block range) whose worker's engine is replaced, once it is initialised, by
:class:`~ark.integrations.mooncake.SteeredTransferEngine` around it: every push takes a
lease from the host's agent for (decode host, the bytes being sent), single-path or, with
``ark_parts``, a multi-path lease whose parts take the push's connections round-robin.
Nothing of vLLM is patched or copied: the connector is a subclass loaded through vLLM's
``kv_connector_module_path``.

``kv_connector_extra_config`` keys read here (the others are Mooncake's own):

* ``ark_cluster``, ``ark_host``: the cluster file and this host's name in it; without them the
  engine is not steered;
* ``ark_parts``: absent or null: one path per push; an integer 0..16: a multi-path lease
  (0: the agent's size-aware choice);
* ``ark_hosts``: ``{data address: cluster host name}`` of the decode hosts, where the
  addresses their instances announce (``VLLM_HOST_IP``) are not the fabric's in the cluster
  file;
* ``ark_steer``: false observes only (no lease; the control of an experiment);
* ``ark_mode_file``: a JSON file ``{"steer": bool, "parts": null | 0..16}`` read again
  whenever it changes, before a push: one running instance can then serve every scheme of
  an experiment in turn (the testbed writes it between runs);
* ``ark_transfer_log``: a file to which each push appends one JSON line (target, bytes,
  start and end, leases, every connection with its port, part and path);
* ``ark_idle_step_s``: seconds (0 .. 0.1; default 0, vLLM's own pace) that an engine step
  which schedules no token waits before it returns. While a request only waits for KV (a
  decode instance pulling, a prefill instance holding blocks until they are pushed),
  vLLM's engine steps every millisecond; on a machine whose cores the engines share with
  the fabric (the testbed), that polling is most of their CPU. A request then notices its
  KV up to this much later.
* ``ark_poll_s``: seconds (0 .. 0.1; default 0, the engine's own wait) between status checks
  of a push written as a polled write (:class:`~ark.integrations.mooncake.SteeredTransferEngine`):
  the engine's synchronous write keeps a core busy asking for its status while the push is
  in flight, which on a machine shared with other instances delays their compute.

On a CPU-only torch, vLLM 0.32's Mooncake worker asks ``torch.accelerator.current_device_index()``
in its constructor, which raises without an accelerator; the index only feeds
``current_platform.set_device``, a no-op on CPU, so the constructor runs with that call
answering 0 when no accelerator exists (and untouched when one does).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Annotated, Any

import msgspec

from ark.core.node import MAX_SPLIT_PARTS
from ark.core.schema import ConfigError, convert
from ark.integrations.mooncake import POOL_ENV, SteeredTransferEngine, Transfer

log = logging.getLogger("ark.integrations.vllm")


class ArkVllmSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``ark_*`` keys of ``kv_connector_extra_config`` (others are ignored here)."""

    cluster: str | None = None
    host: str | None = None
    parts: Annotated[int, msgspec.Meta(ge=0, le=MAX_SPLIT_PARTS)] | None = None
    hosts: Annotated[dict[str, str], msgspec.Meta(max_length=65536)] | None = None
    steer: bool = True
    transfer_log: str | None = None
    mode_file: str | None = None
    idle_step_s: Annotated[float, msgspec.Meta(ge=0.0, le=0.1)] = 0.0
    poll_s: Annotated[float, msgspec.Meta(ge=0.0, le=0.1)] = 0.0

    def __post_init__(self) -> None:
        if (self.cluster is None) != (self.host is None):
            raise ValueError("ark_cluster: give ark_cluster and ark_host together (the cluster file, this host's name)")

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ArkVllmSettings:
        raw = {k[4:]: v for k, v in (extra or {}).items() if k.startswith("ark_")}
        return convert(raw, cls, where="kv_connector_extra_config: ark_")


@contextlib.contextmanager
def cpu_device_index() -> Iterator[None]:
    """``torch.accelerator.current_device_index()`` answers 0 while no accelerator exists."""
    import torch

    if torch.accelerator.current_accelerator() is not None:
        yield
        return
    real = torch.accelerator.current_device_index
    torch.accelerator.current_device_index = lambda: 0  # type: ignore[assignment, unused-ignore]
    try:
        yield
    finally:
        torch.accelerator.current_device_index = real  # type: ignore[assignment, unused-ignore]


class Mode(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What ``ark_mode_file`` holds."""

    steer: bool = True
    parts: Annotated[int, msgspec.Meta(ge=0, le=MAX_SPLIT_PARTS)] | None = None


class ModeFollower:
    """A steered engine whose steering follows a mode file: each push first applies the
    file's mode when the file changed since the last push (a bad file is logged and the
    previous mode kept)."""

    def __init__(self, engine: SteeredTransferEngine, path: str) -> None:
        self.engine, self.path = engine, path
        self._seen: float | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def batch_transfer_sync_write(self, *args: Any, **kw: Any) -> int:
        self.follow()
        return int(self.engine.batch_transfer_sync_write(*args, **kw))

    def follow(self) -> None:
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError:
            return
        if mtime == self._seen:
            return
        self._seen = mtime
        try:
            with open(self.path, "rb") as f:
                mode = msgspec.json.decode(f.read(), type=Mode)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("ark_mode_file %s: %s; keeping the previous mode", self.path, e)
            return
        self.engine.observing = not mode.steer or self.engine.agent is None
        self.engine.parts = mode.parts


class TransferLog:
    """One JSON line per push, appended under a lock (pushes run on a thread pool)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()

    def __call__(self, t: Transfer) -> None:
        line = json.dumps(transfer_record(t))
        with self._lock, open(self.path, "a") as f:
            f.write(line + "\n")


def transfer_record(t: Transfer) -> dict[str, Any]:
    """A push as plain data: what the testbed checks against its spine counters."""
    parts = t.connection_parts()
    return {
        "target": t.target, "dst": t.dst, "bytes": t.nbytes, "t0": t.t0, "t1": t.t1, "reserve_s": t.reserve_s,
        "error": t.error, "ecmp": t.ecmp, "repathed": t.repathed,
        "leases": [{"flow": list(le.flow_id), "path": le.path, "src_port": le.src_port, "reserved": le.reserved}
                   for le in t.leases],
        "connections": [{"sport": c.sport, "dport": c.dport, "steered": c.steered, "part": k,
                         "path": t.port_paths.get(c.sport)} for c, k in zip(t.connections, parts, strict=True)],
    }


def steered_engine(engine: Any, ark: ArkVllmSettings) -> SteeredTransferEngine | ModeFollower:
    """A Mooncake worker's initialised engine inside a steering (or observing) wrapper, and
    one that follows ``ark.mode_file`` when there is one."""
    on_transfer = TransferLog(ark.transfer_log) if ark.transfer_log else None
    if ark.cluster is None or ark.host is None:  # a log without a cluster: observe
        steered = SteeredTransferEngine(engine, agent=None, hosts={}, poll_s=ark.poll_s, on_transfer=on_transfer)
    else:
        from ark.agent.cluster import load

        cl = load(ark.cluster)
        hosts = ark.hosts or {cl.fabric.hosts[h.index].ip: h.name for h in cl.hosts}
        for name in dict.fromkeys(hosts.values()):
            cl.host(name)  # every named host is in the cluster file (one line if not)
        agent = cl.host(ark.host).api if ark.steer else None
        steered = SteeredTransferEngine(engine, agent=agent, hosts=hosts, parts=ark.parts, poll_s=ark.poll_s,
                                        on_transfer=on_transfer)
    return ModeFollower(steered, ark.mode_file) if ark.mode_file else steered


def _connector_class() -> type:
    """Built on first use, so that this module imports (and its parts test) without vLLM."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import MooncakeConnector
    except ImportError as e:
        raise ImportError("ark.integrations.vllm: ArkMooncakeConnector needs vLLM (scripts/install-vllm.sh)") from e

    class ArkMooncakeConnector(MooncakeConnector):  # type: ignore[misc, valid-type, unused-ignore]
        """vLLM's ``MooncakeConnector`` whose pushes are steered onto paths ARK leases."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
            extra = vllm_config.kv_transfer_config.kv_connector_extra_config
            try:
                self.ark = ArkVllmSettings.from_extra(extra)
            except ConfigError as e:
                raise ValueError(str(e)) from None
            # One connection per push, opened from the pushing thread (what a lease can
            # steer); it must be set before the engine initialises.
            os.environ.setdefault(POOL_ENV, "0")
            with cpu_device_index():
                super().__init__(vllm_config, role, kv_cache_config)
            worker = getattr(self, "connector_worker", None)
            if worker is not None and not worker.is_kv_consumer and (self.ark.cluster or self.ark.transfer_log):
                worker.engine = steered_engine(worker.engine, self.ark)

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            if self.ark.idle_step_s and not scheduler_output.total_num_scheduled_tokens:
                time.sleep(self.ark.idle_step_s)  # an idle step: only requests waiting for KV (see ark_idle_step_s)
            return super().build_connector_meta(scheduler_output)

    ArkMooncakeConnector.__module__ = __name__
    return ArkMooncakeConnector


def __getattr__(name: str) -> Any:
    """``ArkMooncakeConnector``, what vLLM's connector factory looks up in this module."""
    if name == "ArkMooncakeConnector":
        cls = globals()[name] = _connector_class()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
