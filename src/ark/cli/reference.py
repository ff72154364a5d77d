"""The reference pages, generated from the code so that they cannot drift from it.

* every ``ark`` command and option, from the click definitions (:func:`cli_markdown`);
* every table and key of the experiment config and of the cluster file, with type,
  default and accepted values, from their msgspec Structs (:func:`config_markdown`);
* every op of the agent's local API and its fields, from the request Structs
  (:func:`api_markdown`);
* every Prometheus metric an agent exports, from its table (:func:`metrics_markdown`).

The documentation site's build hook (``docs/hooks.py``) adds each as a page;
``tests/cli/test_reference.py`` checks that nothing is missing.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Iterator
from typing import Any

import click
import msgspec
from msgspec import inspect as mi

PAGES = {
    "reference/cli.md": "cli_markdown",
    "reference/config.md": "config_markdown",
    "reference/local-api.md": "api_markdown",
    "reference/metrics.md": "metrics_markdown",
}


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


# ---------------------------------------------------------------------- commands
def commands() -> list[tuple[str, click.Command]]:
    """Every command, as (its full name, the click command), groups included."""
    from ark.cli import cli as main

    out: list[tuple[str, click.Command]] = []

    def walk(name: str, cmd: click.Command) -> None:
        out.append((name, cmd))
        if isinstance(cmd, click.Group):
            with click.Context(cmd) as ctx:
                subs = cmd.list_commands(ctx)  # the order `ark --help` lists them in
            for sub in subs:
                walk(f"{name} {sub}", cmd.commands[sub])

    walk("ark", main)
    return out


def _option_row(p: click.Parameter) -> str:
    names = ", ".join(f"`{n}`" for n in (*p.opts, *p.secondary_opts))
    kind = "flag" if isinstance(p, click.Option) and p.is_flag else _cell(p.type.name if not isinstance(
        p.type, click.Choice) else " | ".join(map(str, p.type.choices)))
    # 0 is a default to show; False (a flag off) and () (nothing repeated) are not.
    unset = p.default is None or callable(p.default) or p.default is False or p.default == () or repr(
        p.default).startswith("Sentinel.")
    shown = p.show_default if isinstance(p, click.Option) and isinstance(p.show_default, str) else None
    default = "**required**" if p.required else shown if shown is not None else "" if unset else p.default
    helptext = p.help if isinstance(p, click.Option) and p.help else ""  # arguments have no help
    return f"| {names} | {kind} | {_cell(default)} | {_cell(helptext)} |"


def cli_markdown() -> str:
    lines = ["# Command line", "",
             "Every `ark` command and option, in the order a user meets them (generated from the command "
             "definitions; `ark COMMAND --help` prints the same). **required** marks the options a command cannot "
             "run without.", ""]
    for name, cmd in commands():
        lines += [f"## `{name}`", ""]
        if cmd.help:
            lines += [click.unstyle(cmd.help).replace("\b\n", "").strip(), ""]
        args = [p for p in cmd.params if isinstance(p, click.Argument)]
        if args:
            lines += ["Arguments: " + ", ".join(f"`{a.human_readable_name}`" for a in args), ""]
        opts = [p for p in cmd.params if isinstance(p, click.Option) and not p.hidden]
        if opts:
            lines += ["| option | type | default | meaning |", "|---|---|---|---|", *map(_option_row, opts), ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------- config
def _struct_of(t: Any) -> tuple[type[msgspec.Struct], bool] | None:
    """The Struct a field holds (as a table, or an array of tables), else None."""
    if isinstance(t, mi.UnionType):
        found = [x for x in map(_struct_of, t.types) if x]
        return found[0] if found else None
    if isinstance(t, mi.StructType):
        return t.cls, False
    if isinstance(t, mi.ListType | mi.VarTupleType) and isinstance(t.item_type, mi.StructType):
        return t.item_type.cls, True
    return None


def _tables(cls: type[msgspec.Struct], path: str = "") -> Iterator[tuple[str, type[msgspec.Struct]]]:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    for f in info.fields:
        sub = _struct_of(f.type)
        if sub is None:
            continue
        name = f"{path}.{f.encode_name}" if path else f.encode_name
        yield (f"[[{name}]]" if sub[1] else f"[{name}]"), sub[0]
        yield from _tables(sub[0], name)


FILES = {"experiment": "experiment config (`ark reproduce --config`, `ark compare --config`, `ark simulate`, "
                         "`ark sweep`, `ark testbed up --config`)",
         "cluster": "cluster file (`ark agent --cluster`, `ark arbiter --cluster`)"}


def config_tables() -> list[tuple[str, str, type[msgspec.Struct]]]:
    """(file, table as written in TOML, its Struct): every table of the experiment config and
    of the cluster file (keys of :data:`FILES`), found by walking their Structs."""
    from ark.agent.cluster import ClusterFile
    from ark.sim.config import ExperimentConfig

    exp, cl = FILES
    return [(exp, t, c) for t, c in _tables(ExperimentConfig)] + [(cl, t, c) for t, c in _tables(ClusterFile)]


def _own_keys(cls: type[msgspec.Struct]) -> set[str]:
    """Keys of ``cls`` that are values, not tables of their own."""
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    return {f.encode_name for f in info.fields if _struct_of(f.type) is None}


def _rst(text: str) -> str:
    return text.replace("``", "`")


def table_text(cls: type[msgspec.Struct]) -> str:
    """What a table is for: the first paragraph of its Struct's docstring."""
    doc = inspect.getdoc(cls) or ""
    return _rst(" ".join(doc.split("\n\n", 1)[0].split()))


def key_texts(cls: type[msgspec.Struct]) -> dict[str, str]:
    """Each key's description, from the ``Keys:`` section of its Struct's docstring (one
    ``name: text`` entry per key, continued on lines indented further)."""
    doc = inspect.getdoc(cls) or ""
    out: dict[str, str] = {}
    lines = doc.split("Keys:\n", 1)[1].splitlines() if "Keys:\n" in doc else []
    key = None
    for line in lines:
        if not line.strip():
            break
        m = re.match(r"^    ([a-z_][a-z0-9_]*): (.*)$", line)
        if m:
            key = m.group(1)
            out[key] = m.group(2)
        elif key is not None and line.startswith("        "):
            out[key] += " " + line.strip()
        else:
            break
    return {k: _rst(v) for k, v in out.items()}


def _bounds(t: Any) -> list[str]:
    out = []
    for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"), ("min_length", "length >="),
                      ("max_length", "length <=")):
        v = getattr(t, attr, None)
        if v is not None:
            out.append(f"{sym} {v:g}" if isinstance(v, float) else f"{sym} {v}")
    if getattr(t, "pattern", None):
        out.append(f"matches `{t.pattern}`")
    return out


def type_text(t: Any) -> tuple[str, str]:
    """(the type, its accepted values) of a msgspec type, in words."""
    if isinstance(t, mi.Metadata):  # a string checked against a registry (ark.core.schema.accepted)
        text, acc = type_text(t.type)
        members = (t.extra or {}).get("one_of")
        return (text, "one of " + ", ".join(f"`{v}`" for v in members)) if members else (text, acc)
    if isinstance(t, mi.LiteralType):
        return "one of", ", ".join(f"`{v}`" for v in t.values)
    if isinstance(t, mi.UnionType):
        parts = [type_text(x) for x in t.types]
        return " or ".join(p[0] for p in parts), "; ".join(dict.fromkeys(p[1] for p in parts if p[1]))
    if isinstance(t, mi.NoneType):
        return "none", ""
    if isinstance(t, mi.StructType):
        return f"table ({t.cls.__name__})", ""
    if isinstance(t, mi.ListType | mi.TupleType | mi.VarTupleType | mi.SetType | mi.FrozenSetType):
        inner = getattr(t, "item_type", None)
        if inner is None:
            inner_text = ", ".join(type_text(x)[0] for x in getattr(t, "item_types", ()))
            return f"array [{inner_text}]", ", ".join(_bounds(t))
        text, acc = type_text(inner)
        return f"array of {text}", "; ".join(x for x in (acc, ", ".join(_bounds(t))) if x)
    if isinstance(t, mi.DictType):
        return f"table of {type_text(t.value_type)[0]}", ""
    name = type(t).__name__.removesuffix("Type").lower()
    return {"int": "integer", "float": "number", "str": "string", "bool": "boolean"}.get(name, name), ", ".join(
        _bounds(t))


def _default(f: mi.Field) -> str:
    if f.required:
        return "(required)"
    if f.default is not mi.NODEFAULT:
        v = f.default
        if isinstance(v, float) and math.isinf(v):
            return "inf"
        return f"`{v!r}`" if isinstance(v, str) else f"`{msgspec.json.encode(v).decode()}`" if v is not None else "none"
    if f.default_factory is not mi.NODEFAULT:
        try:
            v = f.default_factory()
        except Exception:  # a factory that needs context: say so rather than guess
            return "(computed)"
        if isinstance(v, msgspec.Struct):
            return "(the table's defaults)"
        return f"`{msgspec.json.encode(v).decode()}`"
    return ""


def struct_fields(cls: type[msgspec.Struct]) -> Iterator[tuple[str, str, str, str, str]]:
    """(key, type, default, accepted values, description) of every field of ``cls`` that is
    a value (its tables have their own section)."""
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    own = _own_keys(cls)
    texts = key_texts(cls)
    for f in info.fields:
        if f.encode_name not in own:
            continue
        kind, accepted = type_text(f.type)
        yield f.encode_name, kind, _default(f), accepted, texts.get(f.encode_name, "")


def heading(file: str, table: str) -> str:
    return f"### `{table}` ({file})"


def config_markdown() -> str:
    lines = ["# Configuration keys", "",
             "Every table and key of the two TOML files ARK reads, with its meaning, type, default and accepted "
             "values (generated from the definitions that check them; [config files](../config-files.md) shows "
             "them in use). An unknown key is refused with a one-line error naming it.", ""]
    last = ""
    for file, table, cls in config_tables():
        if file != last:
            lines += [f"## The {FILES[file]}", ""]
            last = file
        lines += [heading(file, table), "", table_text(cls), "",
                  "| key | meaning | type | default | accepted |", "|---|---|---|---|---|"]
        lines += [f"| `{k}` | {_cell(m)} | {_cell(t)} | {_cell(d)} | {_cell(a)} |" for k, t, d, a, m in
                  struct_fields(cls)]
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------- local API
def api_markdown() -> str:
    from ark.agent.api import REQUESTS

    lines = ["# Local API", "",
             "The agent's local API: one msgpack map per request on its `api` socket (ZeroMQ REQ/REP), "
             "`{\"op\": ..., ...}`; every reply has `ok` and, when `ok` is false, `error` (one line naming the "
             "field). `ark.agent.client.ArkClient` wraps it ([Python client](python-client.md)). Ops and their "
             "fields (generated from the request definitions):", ""]
    for op, cls in REQUESTS.items():
        lines += [f"## `{op}`", "", "| field | type | default | accepted |", "|---|---|---|---|"]
        rows = [f"| `{k}` | {_cell(t)} | {_cell(d)} | {_cell(a)} |" for k, t, d, a, _ in struct_fields(cls)]
        lines += rows or ["| (none) | | | |"]
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------- metrics
def metrics_markdown() -> str:
    from ark.agent.metrics import METRICS

    lines = ["# Metrics", "",
             "What an agent exports in Prometheus text (the cluster file's `metrics_port` on 127.0.0.1, and the "
             "local API's `metrics` op), each labelled `host` (generated from the agent's metric table).", "",
             "| metric | type | meaning |", "|---|---|---|"]
    lines += [f"| `{n}` | {k} | {_cell(d)} |" for n, k, d in METRICS]
    return "\n".join(lines) + "\n"


def page(path: str) -> str:
    """The generated page at ``path`` (a key of :data:`PAGES`)."""
    return _MAKERS[PAGES[path]]()


_MAKERS = {"cli_markdown": cli_markdown, "config_markdown": config_markdown, "api_markdown": api_markdown,
           "metrics_markdown": metrics_markdown}


if __name__ == "__main__":  # python -m ark.cli.reference reference/config.md: one page on stdout
    import sys

    if len(sys.argv) != 2 or sys.argv[1] not in PAGES:
        sys.exit(f"usage: python -m ark.cli.reference PAGE, PAGE one of {', '.join(PAGES)}")
    print(page(sys.argv[1]))
