"""Typed config decoding: the fabric table, and one-line errors that name the field."""

from __future__ import annotations

import math

import msgspec
import pytest

from ark.core.fabric_config import FabricConfig
from ark.core.schema import ConfigError, Count, Positive, convert, explain


def test_fabric_table_defaults_to_the_paper_preset() -> None:
    assert FabricConfig().build() == convert({}, FabricConfig).build()
    f = convert({}, FabricConfig).build()
    assert (f.n_leaves, f.n_spines, f.n_hosts, f.link_bps) == (2, 4, 16, 100e9)


def test_fabric_dimensions_default_to_the_papers_when_some_are_given() -> None:
    f = convert({"spines": 8, "hash": "crc32"}, FabricConfig).build()
    assert (f.n_leaves, f.n_spines, f.n_hosts) == (2, 8, 16) and f.spines[0].hash == "crc32"


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"preset": "paper", "leaves": 4}, "preset: give either a preset or leaves/spines/... , not both"),
        ({"preset": "huge"}, "preset: must be one of paper, scale, scale-8k, clos3-small; got 'huge'"),
        ({"leaves": 0}, "leaves: must be >= 1, got 0"),
        ({"leaves": True}, "leaves: must be an integer or absent; got True"),
        ({"link_gbps": math.inf}, "link_gbps: must be <= 1000000000000000; got inf"),
        ({"link_gbps": math.nan}, "link_gbps: must be > 0; got nan"),
        ({"link_gbps": "fast"}, "link_gbps: must be a number or absent; got 'fast'"),
        ({"hash": "md5"}, "hash: must be one of murmur3-hpcc"),
        ({"prefill_leaves": [0, "x"]}, "prefill_leaves: must be an integer; got 'x' (item 2)"),
        ({"prefill_leaves": [5]}, "prefill_leaves: leaf 5 outside 0..1"),
        ({"spine": 4}, "spine: unknown key; accepted: preset, leaves, spines"),
        ({"preset": "scale", "pods": 2}, "preset: give either a preset or leaves/spines/... , not both"),
        ({"pods": 2, "spines": 4}, "pods: a 3-tier fabric takes pods/leaves_per_pod/aggs_per_pod/cores_per_plane/"),
        ({"pods": 0}, "pods: must be 1..256, got 0"),
        ({"pods": 2, "oversubscription": [2.0]}, "oversubscription: "),
        ({"pods": 2, "oversubscription": [2.0, 0.0]}, "oversubscription"),
        ({"pods": 2, "agg_hash": "md5"}, "agg_hash: must be one of murmur3-hpcc"),
        ({"pods": 2, "agg_seed": -1}, "agg_seed: must be 0..4294967295, got -1"),
        ({"agg_seed": 3}, "agg_hash: only a 3-tier fabric (pods = ...) has an aggregation tier"),
        ({"pods": 2, "leaves_per_pod": 2, "prefill_leaves": [4]}, "prefill_leaves: leaf 4 outside 0..3"),
    ],
)
def test_fabric_table_errors_are_one_line_and_name_the_field(table: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        convert(table, FabricConfig, where="fabric")
    text = str(e.value)
    assert "\n" not in text and text.startswith("fabric.") and message in text, text


class _Host(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    port: Count = 1

    def __post_init__(self) -> None:
        if self.name == "bad":
            raise ValueError("name: 'bad' is reserved")


class _File(msgspec.Struct, forbid_unknown_fields=True):
    hosts: list[_Host]
    rates: tuple[Positive, ...] = ()


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"hosts": [{"name": "a"}, {"name": "bad"}]}, "hosts[1].name: 'bad' is reserved"),
        ({"hosts": [{"name": "a", "port": 0}]}, "hosts[0].port: must be >= 1; got 0"),
        ({"hosts": [{"name": "a", "colour": 1}]}, "hosts[0].colour: unknown key; accepted: name, port"),
        ({"hosts": [{}]}, "hosts[0].name: required"),
        ({}, "hosts: required"),
        ({"hosts": [], "rates": [1, -2]}, "rates: must be > 0; got -2 (item 2)"),
        ({"hosts": [], "extra": {}}, "extra: unknown section; accepted: hosts, rates"),
        ({"hosts": "a"}, "hosts: must be a list; got 'a'"),
    ],
)
def test_explain_names_list_items_and_tables(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        convert(raw, _File)
    assert str(e.value) == message


def test_explain_without_a_path_keeps_the_message() -> None:
    assert explain("Expected `int`, got `str`", "x", int) == "must be an integer; got 'x'"
    assert explain("something odd", {}, dict) == "something odd"
