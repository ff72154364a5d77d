"""Experiment configuration: TOML files and the embedded default (the paper's setup).

Every bad value raises :class:`ConfigError` with a one-line message naming the field and
what it accepts. Example file::

    [fabric]
    preset = "paper"          # or leaves/spines/gpus_per_leaf/link_gbps/nic_gbps
    hash = "crc32"
    transport = "rocev2-4096"

    [workload]
    model = "llama-3-8b"
    qps = [5, 25]
    requests = 1000

    [experiment]
    schemes = ["ecmp", "ark"]
    seeds = 2
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ark.core.hashing import HASH_MODELS
from ark.core.pathmap import ROCE_PORT_RANGE, PathMapError, parse_port_range
from ark.core.topology import HASH_SELECTIONS, PRESETS, TRANSPORTS, Fabric, TopologyError, spine_leaf
from ark.sim.engine import SCHEMES
from ark.sim.serving import GPUS, MODES, PLACEMENTS, AffineLatency, Serving, latency_model
from ark.sim.workload import MODELS, WorkloadError, get_model

DEFAULT_QPS = (1.0, 5.0, 10.0, 15.0, 20.0, 25.0, 30.0)


class ConfigError(ValueError):
    """A configuration value that is missing, of the wrong type or out of range."""


@dataclass(frozen=True)
class FabricConfig:
    preset: str | None = "paper"
    leaves: int = 2
    spines: int = 4
    gpus_per_leaf: int = 8
    link_gbps: float = 100.0
    nic_gbps: float = 100.0
    hash: str = "murmur3-hpcc"
    seed: int | None = None
    selection: str = "modulo"
    transport: str = "rocev2-4096"
    prefill_leaves: tuple[int, ...] | None = None
    decode_leaves: tuple[int, ...] | None = None

    def build(self) -> Fabric:
        kw: dict[str, Any] = dict(
            leaves=self.leaves, spines=self.spines, gpus_per_leaf=self.gpus_per_leaf,
            link_gbps=self.link_gbps, nic_gbps=self.nic_gbps,
        )
        if self.preset is not None:
            kw.update(PRESETS[self.preset])
        try:
            return spine_leaf(
                **kw, hash=self.hash, seed=self.seed, selection=self.selection,
                transport=self.transport, prefill_leaves=self.prefill_leaves,
                decode_leaves=self.decode_leaves,
            )
        except TopologyError as e:
            raise ConfigError(str(e)) from None


@dataclass(frozen=True)
class WorkloadConfig:
    model: str = "llama-3-8b"
    requests: int = 1000
    qps: tuple[float, ...] = DEFAULT_QPS
    theta: float = 0.7
    min_tokens: int = 1024
    max_tokens: int = 55_000
    pd_ratio: float = 20.0
    trace: str | None = None  # replayed, its arrivals rescaled to each QPS of the sweep


@dataclass(frozen=True)
class ServingConfig:
    mode: str = "paper"
    gpu: str = "a100"
    tp: int = 1
    placement: str = "round-robin"
    decode_slots: int = 64
    prefill_base_ms: float | None = None
    prefill_per_token_ms: float | None = None
    decode_step_ms: float | None = None

    def build(self, model: str) -> Serving:
        spec = get_model(model)
        lat = latency_model(spec, self.gpu, self.tp)
        lat = AffineLatency(
            lat.prefill_base_s if self.prefill_base_ms is None else self.prefill_base_ms / 1e3,
            lat.prefill_per_token_s if self.prefill_per_token_ms is None else self.prefill_per_token_ms / 1e3,
            lat.decode_step if self.decode_step_ms is None else self.decode_step_ms / 1e3,
        )
        return Serving(spec, lat, self.mode, self.placement, self.decode_slots)


@dataclass(frozen=True)
class NetworkConfig:
    control_delay_us: float = 20.0
    control_jitter_us: float = 0.0
    dport: int = 4791
    port_range: tuple[int, int] = ROCE_PORT_RANGE


@dataclass(frozen=True)
class ExperimentConfig:
    fabric: FabricConfig = field(default_factory=FabricConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    serving: ServingConfig = field(default_factory=ServingConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    schemes: tuple[str, ...] = SCHEMES
    seeds: tuple[int, ...] = (0, 1, 2)

    def with_overrides(
        self,
        *,
        qps: tuple[float, ...] | None = None,
        requests: int | None = None,
        seeds: tuple[int, ...] | None = None,
        schemes: tuple[str, ...] | None = None,
    ) -> ExperimentConfig:
        cfg = self
        if qps is not None:
            cfg = replace(cfg, workload=replace(cfg.workload, qps=qps))
        if requests is not None:
            cfg = replace(cfg, workload=replace(cfg.workload, requests=requests))
        if seeds is not None:
            cfg = replace(cfg, seeds=seeds)
        if schemes is not None:
            cfg = replace(cfg, schemes=schemes)
        return cfg.validated()

    def validated(self) -> ExperimentConfig:
        """Check cross-field rules; returns self so it chains."""
        self.fabric.build()
        w = self.workload
        if w.model not in MODELS:
            raise ConfigError(f"workload.model: must be one of {', '.join(MODELS)}; got {w.model!r}")
        if w.requests < 1:
            raise ConfigError(f"workload.requests: must be >= 1; got {w.requests}")
        if not w.qps or any(not q > 0 for q in w.qps):
            raise ConfigError(f"workload.qps: must be one or more numbers > 0; got {list(w.qps)}")
        if not 0 < w.theta < 1:
            raise ConfigError(f"workload.theta: must be in (0, 1); got {w.theta}")
        if not 1 <= w.min_tokens <= w.max_tokens:
            raise ConfigError("workload.min_tokens: must be >= 1 and <= workload.max_tokens")
        if w.pd_ratio < 0:
            raise ConfigError(f"workload.pd_ratio: must be >= 0; got {w.pd_ratio}")
        try:
            self.serving.build(w.model)
        except WorkloadError as e:
            raise ConfigError(str(e)) from None
        n = self.network
        if n.control_delay_us < 0 or n.control_jitter_us < 0:
            raise ConfigError("network.control_delay_us: must be >= 0 (and control_jitter_us too)")
        if not 0 <= n.dport <= 0xFFFF:
            raise ConfigError(f"network.dport: must be 0..65535; got {n.dport}")
        for s in self.schemes:
            if s not in SCHEMES:
                raise ConfigError(f"experiment.schemes: each must be one of {', '.join(SCHEMES)}; got {s!r}")
        if not self.schemes:
            raise ConfigError(f"experiment.schemes: must list one or more of {', '.join(SCHEMES)}")
        if not self.seeds:
            raise ConfigError("experiment.seeds: must be a count >= 1 or a list of seeds")
        return self


# ---------------------------------------------------------------------------------------
# TOML parsing
# ---------------------------------------------------------------------------------------
def _num(v: Any, name: str, kind: type = float) -> Any:
    if isinstance(v, bool) or not isinstance(v, int | float) or (kind is int and not isinstance(v, int)):
        what = "an integer" if kind is int else "a number"
        raise ConfigError(f"{name}: must be {what}; got {v!r}")
    return kind(v)


def _choice(v: Any, name: str, accepted: tuple[str, ...] | list[str]) -> str:
    if not isinstance(v, str) or v not in accepted:
        raise ConfigError(f"{name}: must be one of {', '.join(accepted)}; got {v!r}")
    return v


def _int_list(v: Any, name: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise ConfigError(f"{name}: must be a list of integers; got {v!r}")
    return tuple(v)


def parse_seeds(v: Any, name: str = "experiment.seeds") -> tuple[int, ...]:
    """A count N (seeds 0..N-1) or an explicit list."""
    if isinstance(v, int) and not isinstance(v, bool):
        if v < 1:
            raise ConfigError(f"{name}: must be a count >= 1 or a list of seeds; got {v}")
        return tuple(range(v))
    seeds = _int_list(v, name)
    if not seeds or any(s < 0 for s in seeds):
        raise ConfigError(f"{name}: must be a count >= 1 or a list of seeds >= 0; got {v!r}")
    return seeds


def _check_keys(section: str, table: Any, accepted: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise ConfigError(f"{section}: must be a table")
    for k in table:
        if k not in accepted:
            raise ConfigError(f"{section}.{k}: unknown key; accepted: {', '.join(accepted)}")
    return table


_FABRIC_KEYS = (
    "preset", "leaves", "spines", "gpus_per_leaf", "link_gbps", "nic_gbps", "hash", "seed",
    "selection", "transport", "prefill_leaves", "decode_leaves",
)
_WORKLOAD_KEYS = (
    "model", "requests", "qps", "theta", "min_tokens", "max_tokens", "pd_ratio", "trace",
)
_SERVING_KEYS = (
    "mode", "gpu", "tp", "placement", "decode_slots", "prefill_base_ms", "prefill_per_token_ms",
    "decode_step_ms",
)
_NETWORK_KEYS = ("control_delay_us", "control_jitter_us", "dport", "port_range")
_EXPERIMENT_KEYS = ("schemes", "seeds")
_SECTIONS = ("fabric", "workload", "serving", "network", "experiment")


def from_dict(d: dict[str, Any], base_dir: Path | None = None) -> ExperimentConfig:
    for k in d:
        if k not in _SECTIONS:
            raise ConfigError(f"{k}: unknown section; accepted: {', '.join(_SECTIONS)}")
    f = _check_keys("fabric", d.get("fabric", {}), _FABRIC_KEYS)
    explicit = any(k in f for k in ("leaves", "spines", "gpus_per_leaf", "link_gbps", "nic_gbps"))
    preset = f.get("preset", None if explicit else "paper")
    if preset is not None:
        preset = _choice(preset, "fabric.preset", tuple(PRESETS))
        if explicit:
            raise ConfigError("fabric.preset: give either a preset or leaves/spines/... , not both")
    fab = FabricConfig(
        preset=preset,
        leaves=_num(f.get("leaves", 2), "fabric.leaves", int),
        spines=_num(f.get("spines", 4), "fabric.spines", int),
        gpus_per_leaf=_num(f.get("gpus_per_leaf", 8), "fabric.gpus_per_leaf", int),
        link_gbps=_num(f.get("link_gbps", 100.0), "fabric.link_gbps"),
        nic_gbps=_num(f.get("nic_gbps", 100.0), "fabric.nic_gbps"),
        hash=_choice(f.get("hash", "murmur3-hpcc"), "fabric.hash", tuple(HASH_MODELS)),
        seed=None if f.get("seed") is None else _num(f["seed"], "fabric.seed", int),
        selection=_choice(f.get("selection", "modulo"), "fabric.selection", HASH_SELECTIONS),
        transport=_choice(f.get("transport", "rocev2-4096"), "fabric.transport", tuple(TRANSPORTS)),
        prefill_leaves=None if "prefill_leaves" not in f else _int_list(f["prefill_leaves"], "fabric.prefill_leaves"),
        decode_leaves=None if "decode_leaves" not in f else _int_list(f["decode_leaves"], "fabric.decode_leaves"),
    )
    w = _check_keys("workload", d.get("workload", {}), _WORKLOAD_KEYS)
    qps_raw = w.get("qps", list(DEFAULT_QPS))
    if not isinstance(qps_raw, list):
        qps_raw = [qps_raw]
    qps = tuple(_num(q, "workload.qps") for q in qps_raw)
    trace = w.get("trace")
    if trace is not None:
        if not isinstance(trace, str):
            raise ConfigError(f"workload.trace: must be a file path; got {trace!r}")
        tp = Path(trace)
        if not tp.is_absolute() and base_dir is not None:
            tp = base_dir / tp
        if not tp.is_file():
            raise ConfigError(f"workload.trace: no such file: {tp}")
        trace = str(tp)
    wl = WorkloadConfig(
        model=_choice(w.get("model", "llama-3-8b"), "workload.model", tuple(MODELS)),
        requests=_num(w.get("requests", 1000), "workload.requests", int),
        qps=qps,
        theta=_num(w.get("theta", 0.7), "workload.theta"),
        min_tokens=_num(w.get("min_tokens", 1024), "workload.min_tokens", int),
        max_tokens=_num(w.get("max_tokens", 55_000), "workload.max_tokens", int),
        pd_ratio=_num(w.get("pd_ratio", 20.0), "workload.pd_ratio"),
        trace=trace,
    )
    s = _check_keys("serving", d.get("serving", {}), _SERVING_KEYS)

    def opt(key: str) -> float | None:
        return None if key not in s else float(_num(s[key], f"serving.{key}"))

    srv = ServingConfig(
        mode=_choice(s.get("mode", "paper"), "serving.mode", MODES),
        gpu=_choice(s.get("gpu", "a100"), "serving.gpu", GPUS),
        tp=_num(s.get("tp", 1), "serving.tp", int),
        placement=_choice(s.get("placement", "round-robin"), "serving.placement", PLACEMENTS),
        decode_slots=_num(s.get("decode_slots", 64), "serving.decode_slots", int),
        prefill_base_ms=opt("prefill_base_ms"),
        prefill_per_token_ms=opt("prefill_per_token_ms"),
        decode_step_ms=opt("decode_step_ms"),
    )
    n = _check_keys("network", d.get("network", {}), _NETWORK_KEYS)
    pr = n.get("port_range", f"{ROCE_PORT_RANGE[0]}-{ROCE_PORT_RANGE[1]}")
    if not isinstance(pr, str):
        raise ConfigError(f"network.port_range: must be a string LO-HI; got {pr!r}")
    try:
        port_range = parse_port_range(pr)
    except PathMapError as e:
        raise ConfigError(f"network.{e}") from None
    net = NetworkConfig(
        control_delay_us=_num(n.get("control_delay_us", 20.0), "network.control_delay_us"),
        control_jitter_us=_num(n.get("control_jitter_us", 0.0), "network.control_jitter_us"),
        dport=_num(n.get("dport", 4791), "network.dport", int),
        port_range=port_range,
    )
    ex = _check_keys("experiment", d.get("experiment", {}), _EXPERIMENT_KEYS)
    schemes_raw = ex.get("schemes", list(SCHEMES))
    if not isinstance(schemes_raw, list):
        raise ConfigError(f"experiment.schemes: must be a list of {', '.join(SCHEMES)}")
    schemes = tuple(_choice(x, "experiment.schemes", SCHEMES) for x in schemes_raw)
    seeds = parse_seeds(ex.get("seeds", 3))
    return ExperimentConfig(fab, wl, srv, net, schemes, seeds).validated()


def load(path: str | Path) -> ExperimentConfig:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"config: cannot read {path}: {e.strerror}") from None
    try:
        d = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config: {path} is not valid TOML: {e}") from None
    return from_dict(d, p.parent)


def default() -> ExperimentConfig:
    """The embedded default: the published experiment (ARK.md section 4)."""
    return ExperimentConfig().validated()
