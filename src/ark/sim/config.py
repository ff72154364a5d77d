"""Experiment configuration: TOML files and the embedded default (the paper's setup).

A file has up to five tables; whatever it leaves out keeps the default. Types and ranges
are checked by :mod:`ark.core.schema`, so every bad value stops with one line naming the
field and what it accepts. Example::

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
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from ark.core.fabric_config import FabricConfig
from ark.core.pathmap import ROCE_PORT_RANGE, PathMapError, check_port_range, parse_port_range
from ark.core.schema import ConfigError, Count, NonNegative, Port, Positive, accepted, convert, one_of
from ark.sim.arbiter_control import unsupported
from ark.sim.balancers import TWO_TIER_ONLY, SchemeParams
from ark.sim.engine import ARK_SCHEMES, REPRODUCED, SCHEMES
from ark.sim.failure import FailureError, LinkChange
from ark.sim.serving import GPUS, AffineLatency, Serving, latency_model
from ark.sim.workload import MODELS, WorkloadError, model_spec

__all__ = ["ConfigError", "ExperimentConfig", "default", "load", "parse_seeds"]

DEFAULT_QPS = (1.0, 5.0, 10.0, 15.0, 20.0, 25.0, 30.0)


class WorkloadConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[workload]`` table: the requests (model, count, loads, prompt lengths, or a trace).

    Keys:
        model: The served model; sets the KV cache per token (2 x layers x KV heads x head
            size x 2 bytes) and scales the prefill and decode latencies.
        requests: Requests per run (with a trace: its first this many rows). A run must be long
            enough to reach a steady state: the command warns and names a count when it is not.
        qps: Request arrival rates to sweep (Poisson arrivals), one run per rate and seed.
        theta: Zipf skew of prompt lengths (Vidur's generator), in (0, 1).
        min_tokens: Shortest request (prompt plus output), tokens.
        max_tokens: Longest request (prompt plus output), tokens.
        pd_ratio: Prompt tokens per output token (output = ceil(total / (1 + pd_ratio))).
        trace: A trace to replay instead of the generator (Azure LLM trace columns
            TIMESTAMP,ContextTokens,GeneratedTokens): its first ``requests`` rows, arrivals
            rescaled to each QPS; a relative path is read from the config file's folder.
    """

    model: Annotated[str, accepted(MODELS)] = "llama-3-8b"
    requests: Count = 1000
    qps: Positive | tuple[Positive, ...] = DEFAULT_QPS
    theta: float = 0.7
    min_tokens: Count = 1024
    max_tokens: Count = 55_000
    pd_ratio: NonNegative = 20.0
    trace: str | None = None  # replayed, its arrivals rescaled to each QPS of the sweep

    def __post_init__(self) -> None:
        one_of("model", self.model, MODELS)
        if not 0 < self.theta < 1:
            raise ValueError(f"theta: must be in (0, 1); got {self.theta}")
        if self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens: must be >= 1 and <= workload.max_tokens")
        qps = (float(self.qps),) if isinstance(self.qps, int | float) else tuple(float(q) for q in self.qps)
        if not qps:
            raise ValueError("qps: must be one or more numbers > 0; got []")
        msgspec.structs.force_setattr(self, "qps", qps)  # a file may give one number

    @property
    def qps_list(self) -> tuple[float, ...]:
        return self.qps if isinstance(self.qps, tuple) else (self.qps,)


class ServingConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[serving]`` table: how prefill and decode GPUs serve requests around the KV transfer.

    Keys:
        mode: ``paper``: prefill and the first decode step are fixed offsets, no queueing (the
            published experiment); ``queued``: one prefill at a time per prefill GPU and
            ``decode_slots`` per decode GPU, first come first served.
        gpu: The GPU whose latency profile prefill and decode take.
        tp: Tensor parallelism: divides the latencies.
        placement: How requests pick their prefill and decode GPUs: in turn, or at random.
        decode_slots: ``queued``: requests a decode GPU serves at once.
        prefill_base_ms: Overrides the profile's fixed prefill time, ms.
        prefill_per_token_ms: Overrides the profile's prefill time per prompt token, ms.
        decode_step_ms: Overrides the profile's decode step, ms.
        kv_transfer: ``whole``: one gapless transfer per KV cache; ``per-layer``: one chunk per
            model layer with ``layer_gap_us`` idle between chunks (then flowlets exist).
        layer_gap_us: ``per-layer``: idle time between two layers' chunks, us.
    """

    mode: Literal["paper", "queued"] = "paper"
    gpu: Annotated[str, accepted(GPUS)] = "a100"
    tp: Count = 1
    # "auto": "random" when the pools span pods (3-tier fabrics), else "round-robin"
    placement: Literal["auto", "round-robin", "random"] = "auto"
    decode_slots: Count = 64
    prefill_base_ms: NonNegative | None = None
    prefill_per_token_ms: NonNegative | None = None
    decode_step_ms: NonNegative | None = None
    # How the engine sends a KV cache: one gapless transfer, or one chunk per model layer
    # with layer_gap_us of idle time between chunks (then flowlets exist).
    kv_transfer: Literal["whole", "per-layer"] = "whole"
    layer_gap_us: NonNegative = 200.0

    def __post_init__(self) -> None:
        one_of("gpu", self.gpu, GPUS)

    def chunks(self, model: str) -> int:
        """Chunks per KV transfer: 1, or the model's layer count."""
        return model_spec(model).layers if self.kv_transfer == "per-layer" else 1

    def build(self, model: str) -> Serving:
        lat = latency_model(model_spec(model), self.gpu, self.tp)
        lat = AffineLatency(
            lat.prefill_base_s if self.prefill_base_ms is None else self.prefill_base_ms / 1e3,
            lat.prefill_per_token_s if self.prefill_per_token_ms is None else self.prefill_per_token_ms / 1e3,
            lat.decode_step if self.decode_step_ms is None else self.decode_step_ms / 1e3,
        )
        return Serving(model_spec(model), lat, self.mode, self.placement, self.decode_slots)


class NetworkConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[network]`` table: ports, and the control plane that carries reservations.

    Keys:
        control_delay_us: One-way delay of a control message between two hosts, us; races
            happen inside it.
        control_jitter_us: Each control message's delay is off by up to this much, us.
        dport: The destination port of KV flows (4791: RoCEv2); the ECMP hash includes it.
        port_range: The source ports a host may pick from, ``LO-HI`` (49152-65535: the ports a
            RoCEv2 flow label reaches).
        clock_skew_us: Each host's clock is off by a uniform draw in [0, this), us (race
            resolution compares timestamps).
        control_path: ``separate``: a management network; ``data-fabric``: control messages
            wait behind the data fabric's standing queues (``data_queue_kb``).
        data_queue_kb: ``data-fabric``: the standing queue at every switch egress that data
            keeps saturated, kB.
        control: Who decides for the ARK schemes: every host on its replica (``broadcast``) or
            one arbiter that each host asks (``arbiter``).
        arbiter_rtt_us: ``arbiter``: a request's round trip host -> arbiter -> host, us.
    """

    control_delay_us: NonNegative = 20.0
    control_jitter_us: NonNegative = 0.0
    dport: Port = 4791
    port_range: str | tuple[int, int] = ROCE_PORT_RANGE  # "LO-HI" in a file
    clock_skew_us: NonNegative = 0.0  # each host's clock is off by a uniform draw in [0, this)
    # "data-fabric": control messages cross the data fabric and wait behind its standing
    # queues (data_queue_kb at every switch egress that data keeps saturated).
    control_path: Literal["separate", "data-fabric"] = "separate"
    data_queue_kb: NonNegative = 100.0
    # Who decides for the ARK schemes: every host on its own replica, hearing the others'
    # messages control_delay_us late ("broadcast"), or one arbiter that each host asks
    # and waits arbiter_rtt_us for (request round trip host -> arbiter -> host).
    control: Literal["broadcast", "arbiter"] = "broadcast"
    arbiter_rtt_us: NonNegative = 200.0

    def __post_init__(self) -> None:
        try:
            if isinstance(self.port_range, str):
                msgspec.structs.force_setattr(self, "port_range", parse_port_range(self.port_range))
            else:
                check_port_range(self.port_range)
        except PathMapError as e:
            raise ValueError(str(e)) from None
        if self.control == "arbiter":
            why = unsupported(jitter_s=self.control_jitter_us, skew_s=self.clock_skew_us,
                              control_on_data=self.control_path == "data-fabric", link_down=False, parts=1)
            if why:
                raise ValueError(f"control: \"arbiter\" {why}")

    @property
    def source_ports(self) -> tuple[int, int]:
        assert isinstance(self.port_range, tuple)  # normalised on decoding
        return self.port_range


class RunsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[experiment]`` table: which schemes and seeds a sweep runs.

    Keys:
        schemes: The load-balancing schemes to run, each on the same workloads.
        seeds: A count N (seeds 0..N-1) or a list of seeds; each seed fixes one workload per QPS.
    """

    schemes: tuple[Annotated[str, accepted(SCHEMES)], ...] = REPRODUCED
    seeds: int | tuple[int, ...] = 3  # a count N (seeds 0..N-1) or a list

    def __post_init__(self) -> None:
        if not self.schemes:
            raise ValueError(f"schemes: must list one or more of {', '.join(SCHEMES)}")
        for s in self.schemes:
            one_of("schemes", s, SCHEMES)
        msgspec.structs.force_setattr(self, "seeds", parse_seeds(self.seeds, "seeds", ValueError))

    @property
    def seed_list(self) -> tuple[int, ...]:
        return self.seeds if isinstance(self.seeds, tuple) else (self.seeds,)


class ExperimentConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A whole experiment file; ``ExperimentConfig()`` is the embedded default.

    Keys:
        fabric: The fabric.
        workload: The requests.
        serving: Prefill and decode.
        network: Ports and the control plane.
        experiment: Schemes and seeds.
        params: Per-scheme parameters.
        failure: One link change during each run.
    """

    fabric: FabricConfig = msgspec.field(default_factory=FabricConfig)
    workload: WorkloadConfig = msgspec.field(default_factory=WorkloadConfig)
    serving: ServingConfig = msgspec.field(default_factory=ServingConfig)
    network: NetworkConfig = msgspec.field(default_factory=NetworkConfig)
    experiment: RunsConfig = msgspec.field(default_factory=RunsConfig)
    params: SchemeParams = msgspec.field(default_factory=SchemeParams)  # [params.plb], [params.split], ...
    failure: LinkChange | None = None

    def __post_init__(self) -> None:
        flat = [s for s in self.schemes if s in TWO_TIER_ONLY]
        if flat and self.fabric.three_tier:
            raise ValueError(f"experiment.schemes: {', '.join(flat)} needs a 2-tier spine-leaf fabric; this one is "
                             "3-tier (leave it out of the list)")
        if self.failure is not None:
            try:
                self.failure.check(self.fabric.build())
            except FailureError as e:
                raise ValueError(str(e)) from None
        if self.network.control == "arbiter" and any(s in ARK_SCHEMES for s in self.schemes):
            split = "ark-split" in self.schemes
            why = unsupported(jitter_s=0.0, skew_s=0.0, control_on_data=False,
                              link_down=self.failure is not None and self.failure.down,
                              parts=self.params.split.parts if split else 1)
            if why:
                raise ValueError(f"network.control: \"arbiter\" {why}")

    @property
    def schemes(self) -> tuple[str, ...]:
        return self.experiment.schemes

    @property
    def seeds(self) -> tuple[int, ...]:
        return self.experiment.seed_list

    def with_overrides(
        self,
        *,
        qps: tuple[float, ...] | None = None,
        requests: int | None = None,
        seeds: tuple[int, ...] | None = None,
        schemes: tuple[str, ...] | None = None,
        failure: dict[str, Any] | None = None,
    ) -> ExperimentConfig:
        """The same experiment with command-line overrides, checked like a file."""
        d: dict[str, Any] = msgspec.to_builtins(self)
        for table, key, value in (("workload", "qps", qps), ("workload", "requests", requests),
                                  ("experiment", "seeds", seeds), ("experiment", "schemes", schemes)):
            if value is not None:
                d[table][key] = list(value) if isinstance(value, tuple) else value
        if failure is not None:
            d["failure"] = {**(d.get("failure") or {}), **failure}
        return from_dict(d)


def parse_seeds(v: Any, name: str = "experiment.seeds", error: type[ValueError] = ConfigError) -> tuple[int, ...]:
    """A count N (seeds 0..N-1) or an explicit list of seeds >= 0."""
    if isinstance(v, int) and not isinstance(v, bool):
        if v < 1:
            raise error(f"{name}: must be a count >= 1 or a list of seeds; got {v}")
        return tuple(range(v))
    if not isinstance(v, list | tuple) or not v or any(type(s) is not int or s < 0 for s in v):
        raise error(f"{name}: must be a count >= 1 or a list of seeds >= 0; got {v!r}")
    return tuple(v)


def from_dict(d: dict[str, Any], base_dir: Path | None = None) -> ExperimentConfig:
    """Decode a parsed experiment file (relative trace paths resolve against ``base_dir``)."""
    cfg = convert(d, ExperimentConfig)
    trace = cfg.workload.trace
    if trace is not None:
        tp = Path(trace)
        if not tp.is_absolute() and base_dir is not None:
            tp = base_dir / tp
        if not tp.is_file():
            raise ConfigError(f"workload.trace: no such file: {tp}")
        cfg = msgspec.structs.replace(cfg, workload=msgspec.structs.replace(cfg.workload, trace=str(tp)))
    try:
        cfg.serving.build(cfg.workload.model)
    except WorkloadError as e:
        raise ConfigError(str(e)) from None
    return cfg


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
    """The embedded default: the published experiment (2 leaves, 4 spines, LLaMA-3-8B, Zipf 0.7)."""
    return ExperimentConfig()
