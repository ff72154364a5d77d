"""The generated reference (ark.cli.reference, the documentation site's reference pages):
every command and option, config key, local API op and field, and metric appears."""

from __future__ import annotations

import importlib
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


def test_commands_come_in_the_order_a_user_meets_them_and_required_options_are_marked() -> None:
    names = [n for n, _ in ref.commands()]
    assert names[1:4] == ["ark reproduce", "ark compare", "ark simulate"]
    assert names.index("ark testbed up") < names.index("ark testbed run") < names.index("ark testbed down")
    assert names.index("ark bench") > names.index("ark agent")
    text = ref.cli_markdown()
    section = text.split("## `ark pathmap`\n", 1)[1].split("\n## `", 1)[0]
    assert "| `--hash` | " in section and "| **required** |" in section.split("| `--hash` |", 1)[1].splitlines()[0]


def test_every_option_is_described_and_shows_its_default() -> None:
    """One way of showing a default everywhere (click's [default: ...]); none in a help text."""
    for name, cmd in ref.commands():
        for p in cmd.params:
            if not isinstance(p, click.Option) or p.hidden:
                continue
            assert p.help and "(default" not in p.help, (name, p.opts)
            if not (p.is_flag or p.required):
                assert isinstance(p.show_default, str) or (p.show_default is True and p.default not in (None, ())), (
                    name, p.opts, p.default)


def test_several_schemes_are_given_one_way_everywhere() -> None:
    for name, cmd in ref.commands():
        for p in cmd.params:
            if isinstance(p, click.Option) and ("--scheme" in p.opts or "--schemes" in p.opts):
                assert p.opts[:2] == ["--schemes", "--scheme"] and p.multiple, name


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
    assert "| `lease_min_s` | The shortest lease, s. | number | `1.0` | > 0, <= 3600 |" in text
    assert "| `control` | `broadcast`: every agent keeps a replica of the table; `arbiter`: agents ask the " \
           "`[[arbiters]]` for every lease. | one of | `'broadcast'` |" in text
    assert "# Configuration keys" in text and "ark run" not in text  # no such command


def test_every_table_and_key_has_a_description_and_none_describes_a_key_that_is_not_there() -> None:
    for file, table, cls in ref.config_tables():
        assert len(ref.table_text(cls)) > 20, (file, table)
        texts = ref.key_texts(cls)
        assert set(texts) == set(_keys(cls)), (table, set(_keys(cls)) ^ set(texts))
        assert all(len(t) > 5 for t in texts.values()), table
        for key, _, _, _, meaning in ref.struct_fields(cls):
            assert meaning == texts[key], (table, key)
    text = ref.config_markdown()
    assert text.count("| key | meaning | type | default | accepted |") == len(ref.config_tables())


def test_strings_checked_against_a_registry_list_what_they_accept() -> None:
    from ark.core.hashing import HASH_MODELS
    from ark.core.protocol import POLICIES
    from ark.core.topology import HASH_SELECTIONS, TRANSPORTS, preset_names
    from ark.sim.engine import SCHEMES
    from ark.sim.serving import GPUS
    from ark.sim.workload import MODELS

    rows = {line.split(" | ")[0]: line for line in ref.config_markdown().splitlines() if line.startswith("| `")}
    for key, values in (("policy", POLICIES), ("model", MODELS), ("gpu", GPUS), ("schemes", SCHEMES),
                        ("preset", preset_names()), ("hash", HASH_MODELS), ("selection", HASH_SELECTIONS),
                        ("transport", TRANSPORTS), ("agg_hash", HASH_MODELS), ("agg_selection", HASH_SELECTIONS)):
        assert rows[f"| `{key}`"].endswith("| one of " + ", ".join(f"`{v}`" for v in values) + " |"), key


def test_every_string_a_check_refuses_values_of_lists_what_it_accepts() -> None:
    """A string key is free text (a name, a path, an address, a key, LO-HI) or lists its
    accepted values: every other string key is one of those named here."""
    free = {"trace", "port_range", "state_dir", "pathmap_dir", "routers_file", "name", "control", "api",
            "public_key", "sign_key", "secret_key_file", "sends_to"}
    for _, table, cls in ref.config_tables():
        for key, kind, _, accepted, _ in ref.struct_fields(cls):
            if "string" in kind and key not in free:
                assert accepted.startswith("one of") or kind.startswith("one of"), (table, key)


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
    for page in ref.PAGES:  # no directory URLs: the site opens from disk too
        assert (tmp_path / page.replace(".md", ".html")).is_file(), page
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        check = importlib.import_module("site-check")
    finally:
        sys.path.pop(0)
    checked, bad = check.broken_links(tmp_path)
    assert checked > 1000 and not bad, bad[:5]
