"""The generated reference (ark.cli.reference, the documentation site's reference pages):
every command and option, config key, local API op and field, and metric appears."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import click
import msgspec
import pytest

from ark.agent.api import REQUESTS
from ark.agent.metrics import COUNTERS, METRICS
from ark.cli import reference as ref

ROOT = Path(__file__).resolve().parents[2]


def test_every_command_and_option_appears() -> None:
    text = ref.cli_markdown()
    names = [n for n, _ in ref.commands()]
    assert {"ark", "ark agent", "ark testbed roce-check", "ark bench verbs", "ark preload"} <= set(names)
    for name, cmd in ref.commands():
        assert f"## `{name}`" in text
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.hidden:
                assert all(f"`{o}`" in text for o in p.opts), (name, p.opts)


def test_each_option_is_in_its_own_command_s_section_with_its_default() -> None:
    text = ref.cli_markdown()
    for name, cmd in ref.commands():
        section = text.split(f"## `{name}`\n", 1)[1].split("\n## `", 1)[0]
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.hidden:
                row = next((line for line in section.splitlines() if line.startswith(f"| `{p.opts[0]}`")), None)
                assert row is not None, (name, p.opts)
                if isinstance(p.default, int) and not isinstance(p.default, bool):
                    assert f"| {p.default} |" in row, (name, p.opts, row)


def _keys(cls: type[msgspec.Struct]) -> list[str]:
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    return [f.encode_name for f in info.fields]


def test_every_config_table_and_key_appears_with_its_default() -> None:
    text = ref.config_markdown()
    tables = [t for _, t, _ in ref.config_tables()]
    assert {"[fabric]", "[workload]", "[serving]", "[network]", "[experiment]", "[params]", "[params.plb]",
            "[params.split]", "[failure]", "[cluster]", "[[hosts]]", "[[arbiters]]"} <= set(tables)
    for file, table, cls in ref.config_tables():
        section = text.split(ref.heading(file, table), 1)[1].split("### ", 1)[0]
        for key in _keys(cls):
            sub = ref._struct_of(msgspec.inspect.type_info(cls).fields[_keys(cls).index(key)].type)  # type: ignore[union-attr]
            if sub is None:  # a value here; a table has its own section, checked in its turn
                assert f"| `{key}` |" in section, (table, key)
    assert "| `lease_min_s` | number | `1.0` | > 0, <= 3600 |" in text
    assert "| `control` | one of | `'broadcast'` |" in text


def test_strings_checked_against_a_registry_list_what_they_accept() -> None:
    from ark.core.protocol import POLICIES
    from ark.core.topology import preset_names
    from ark.sim.engine import SCHEMES
    from ark.sim.serving import GPUS
    from ark.sim.workload import MODELS

    rows = {line.split(" | ")[0]: line for line in ref.config_markdown().splitlines() if line.startswith("| `")}
    for key, values in (("policy", POLICIES), ("model", MODELS), ("gpu", GPUS), ("schemes", SCHEMES),
                        ("preset", preset_names())):
        assert rows[f"| `{key}`"].endswith("| one of " + ", ".join(f"`{v}`" for v in values) + " |"), key


def test_every_local_api_op_and_field_appears() -> None:
    text = ref.api_markdown()
    for op, cls in REQUESTS.items():
        section = text.split(f"## `{op}`", 1)[1].split("## ", 1)[0]
        for key in _keys(cls):
            assert f"| `{key}` |" in section, (op, key)


def test_every_metric_appears_and_the_table_is_what_the_collector_exports() -> None:
    text = ref.metrics_markdown()
    assert all(f"| `{name}` |" in text for name, _, _ in METRICS)
    assert [m[0] for m in METRICS[:len(COUNTERS)]] == [f"{c[0]}_total" for c in COUNTERS]
    assert {k for _, k, _ in METRICS} == {"counter", "gauge", "histogram"}


def test_the_site_builds_strictly_with_the_generated_pages(tmp_path) -> None:
    if shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("the docs extra is not installed (pip install -e '.[docs]'): CI builds the site itself")
    res = subprocess.run([str(Path(sys.executable).parent / "mkdocs"), "build", "--strict", "-d", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    for page in ref.PAGES:
        assert (tmp_path / page.removesuffix(".md") / "index.html").exists(), page
