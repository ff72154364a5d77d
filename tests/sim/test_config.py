"""Experiment files: defaults, normalisation, overrides, and what a round trip keeps."""

from __future__ import annotations

import msgspec
import pytest

from ark.sim import config
from ark.sim.config import ConfigError, ExperimentConfig, from_dict


def test_an_empty_file_is_the_embedded_default() -> None:
    assert from_dict({}) == config.default() == ExperimentConfig()
    cfg = config.default()
    assert cfg.workload.qps == (1.0, 5.0, 10.0, 15.0, 20.0, 25.0, 30.0) and cfg.seeds == (0, 1, 2)
    assert cfg.network.source_ports == (49152, 65535) and cfg.schemes == ("ecmp", "ark", "ark-balance", "spray")


def test_scalars_and_strings_are_normalised() -> None:
    cfg = from_dict({"workload": {"qps": 12}, "experiment": {"seeds": 2}, "network": {"port_range": "100-200"}})
    assert cfg.workload.qps == (12.0,) and cfg.seeds == (0, 1) and cfg.network.port_range == (100, 200)


def test_a_config_survives_a_round_trip_through_builtins() -> None:
    cfg = from_dict({"fabric": {"spines": 8, "hash": "crc32"}, "workload": {"qps": [3, 4]},
                     "experiment": {"seeds": [4, 7], "schemes": ["ecmp", "ark"]}})
    assert from_dict(msgspec.to_builtins(cfg)) == cfg


def test_overrides_are_checked_like_a_file() -> None:
    cfg = config.default().with_overrides(qps=(7.0,), requests=10, seeds=(3,), schemes=("ark",))
    assert (cfg.workload.qps, cfg.workload.requests, cfg.seeds, cfg.schemes) == ((7.0,), 10, (3,), ("ark",))
    with pytest.raises(ConfigError, match=r"^workload.requests: must be >= 1; got 0$"):
        config.default().with_overrides(requests=0)
    with pytest.raises(ConfigError, match=r"^experiment.schemes: must be one of ecmp, ark, ark-balance, spray, plb, letflow, conga, hedera, ark-split, "
                       r"ecmp-split, oracle-path, ark-conn, ecmp-conn; got 'x'$"):
        config.default().with_overrides(schemes=("x",))


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"workload": {"theta": 1.5}}, "workload.theta: must be in (0, 1); got 1.5"),
        ({"workload": {"min_tokens": 10, "max_tokens": 5}}, "workload.min_tokens: must be >= 1 and <= workload.max_tokens"),
        ({"workload": {"qps": []}}, "workload.qps: must be one or more numbers > 0; got []"),
        ({"serving": {"gpu": "tpu"}}, "serving.gpu: must be one of a100, h100; got 'tpu'"),
        ({"serving": {"tp": 0}}, "serving.tp: must be >= 1; got 0"),
        ({"network": {"dport": 70000}}, "network.dport: must be <= 65535; got 70000"),
        ({"network": {"control_delay_us": -1}}, "network.control_delay_us: must be >= 0; got -1"),
        ({"experiment": {"seeds": [1, -1]}}, "experiment.seeds: must be a count >= 1 or a list of seeds >= 0; got (1, -1)"),
    ],
)
def test_bad_values_name_the_field(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        from_dict(raw)
    assert str(e.value) == message


def test_oversubscription_on_a_2_tier_fabric_sets_the_link_rate() -> None:
    from ark.sim.config import from_dict

    fab = from_dict({"fabric": {"leaves": 8, "spines": 4, "gpus_per_leaf": 8, "oversubscription": 2}}).fabric.build()
    assert fab.link_bps == 100e9 and fab.oversubscription() == (2.0,)
    fab = from_dict({"fabric": {"leaves": 2, "spines": 4, "gpus_per_leaf": 8, "nic_gbps": 200,
                                "oversubscription": 1.0}}).fabric.build()
    assert fab.link_bps == 400e9 and fab.oversubscription() == (1.0,)
    for fabric, needles in (
        ({"leaves": 8, "oversubscription": [2.0, 1.0]}, ["fabric.oversubscription", "one number", "3-tier"]),
        ({"leaves": 8, "link_gbps": 100, "oversubscription": 2.0}, ["fabric.oversubscription", "not both"]),
        ({"pods": 2, "oversubscription": 2.0}, ["fabric.oversubscription", "[leaf tier, aggregation tier]"]),
        ({"pods": 2, "oversubscription": [2.0]}, ["fabric.oversubscription", "[leaf tier, aggregation tier]"]),
        ({"leaves": 8, "oversubscription": 0}, ["fabric.oversubscription"]),
    ):
        with pytest.raises(ConfigError) as e:
            from_dict({"fabric": fabric})
        assert all(n in str(e.value) for n in needles), (fabric, str(e.value))
    three = from_dict({"fabric": {"pods": 2, "oversubscription": [2.0, 1.0]}}).fabric
    assert three.three_tier and three.build().oversubscription() == (2.0, 1.0)
