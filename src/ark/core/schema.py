"""Typed decoding of configuration files with one-line errors that name the field.

Every configuration in ARK (experiment files, cluster files, testbed specs) is a tree of
frozen :class:`msgspec.Struct` types. msgspec checks types and numeric ranges while it
converts the parsed TOML; :func:`convert` turns its error into one line such as
``fabric.spines: must be >= 1; got 0`` or ``cluster.polcy: unknown key; accepted: ...``.

Checks msgspec cannot express (membership in a registry, relations between fields) live
in each Struct's ``__post_init__`` and raise ``ValueError("field: what is wrong")``; the
path of the enclosing table is prefixed, so the user sees ``cluster.peer_timeout_s: ...``.
"""

from __future__ import annotations

import math
import re
import typing
from collections.abc import Iterable
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import inspect as mi

T = TypeVar("T")

# Finite ranges: every float field carries bounds, which also rejects NaN and inf.
Positive = Annotated[float, msgspec.Meta(gt=0, le=1e15)]
NonNegative = Annotated[float, msgspec.Meta(ge=0, le=1e15)]
Count = Annotated[int, msgspec.Meta(ge=1, le=2**31)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]


class ConfigError(ValueError):
    """A configuration value that is missing, of the wrong type or out of range."""


def accepted(values: Iterable[str]) -> msgspec.Meta:
    """Annotates a string field checked by :func:`one_of` with the values it accepts, for the
    generated reference: ``policy: Annotated[str, accepted(POLICIES)]``."""
    return msgspec.Meta(extra={"one_of": tuple(values)})


def one_of(name: str, value: object, accepted: Iterable[str]) -> None:
    """Raise the standard error when ``value`` is not one of ``accepted``."""
    acc = list(accepted)
    if value not in acc:
        raise ValueError(f"{name}: must be one of {', '.join(acc)}; got {value!r}")


def finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{name}: must be a finite number; got {value!r}")


def convert(raw: Any, type_: type[T], *, error: type[ConfigError] = ConfigError, where: str = "") -> T:
    """Decode ``raw`` (parsed TOML or JSON) into ``type_``; any problem is one ``error`` line."""
    try:
        return msgspec.convert(raw, type_, strict=True)
    except msgspec.ValidationError as e:
        raise error(explain(str(e), raw, type_, where)) from None


_AT = re.compile(r"^(?P<msg>.*) - at `\$(?P<path>[^`]*)`$", re.S)
_PART = re.compile(r"\.([A-Za-z_][\w-]*)|\[(\d+)\]")
_TYPES = {
    "int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
    "array": "a list", "object": "a table", "null": "absent",
}


def _parts(path: str) -> list[str | int]:
    return [m.group(1) if m.group(1) is not None else int(m.group(2)) for m in _PART.finditer(path)]


def _value_at(raw: Any, parts: list[str | int]) -> Any:
    for p in parts:
        try:
            raw = raw[p]
        except (KeyError, IndexError, TypeError):
            return None
    return raw


def _struct_at(type_: Any, parts: list[str | int]) -> mi.StructType | None:
    t: Any = mi.type_info(type_)
    for p in parts:
        while isinstance(t, mi.UnionType | mi.Metadata):
            t = next((x for x in t.types if isinstance(x, mi.StructType | mi.ListType)), None) \
                if isinstance(t, mi.UnionType) else t.type
        if isinstance(t, mi.StructType) and isinstance(p, str):
            t = next((f.type for f in t.fields if f.name == p), None)
        elif isinstance(t, mi.ListType | mi.VarTupleType) and isinstance(p, int):
            t = t.item_type
        else:
            return None
    while isinstance(t, mi.Metadata):
        t = t.type
    return t if isinstance(t, mi.StructType) else None


def _name(parts: list[str | int], where: str) -> tuple[str, str]:
    """(dotted field name, trailing note): a list item of scalars is named by its list."""
    note = ""
    if parts and isinstance(parts[-1], int):
        note = f" (item {parts[-1] + 1})"
        parts = parts[:-1]
    out = where
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out, note


def _kind(spec: str) -> str:
    names = [_TYPES.get(s.strip(), s.strip()) for s in spec.split("|")]
    return " or ".join(names)


def explain(message: str, raw: Any, type_: Any, where: str = "") -> str:
    """One line for a msgspec validation error: field, what it accepts, what it got."""
    m = _AT.match(message)
    msg, parts = (m.group("msg"), _parts(m.group("path"))) if m else (message, [])
    unknown = re.match(r"Object contains unknown field `(.+)`", msg)
    if unknown:
        st = _struct_at(type_, parts)
        accepted = ", ".join(f.name for f in st.fields) if st else "?"
        name, _ = _name([*parts, unknown.group(1)], where)
        what = "unknown section" if not parts and not where else "unknown key"
        return f"{name}: {what}; accepted: {accepted}"
    missing = re.match(r"Object missing required field `(.+)`", msg)
    if missing:
        return f"{_name([*parts, missing.group(1)], where)[0]}: required"
    name, note = _name(parts, where)
    lead = f"{name}: " if name else ""
    got = _value_at(raw, parts)
    typed = re.match(r"Expected `([^`]+)`, got `[^`]+`$", msg)
    if typed:
        return f"{lead}must be {_kind(typed.group(1))}; got {got!r}{note}"
    ranged = re.match(r"Expected `([^`]+)` (>=|<=|>|<) (\S+)$", msg)
    if ranged:
        bound = ranged.group(3)
        bound = bound[:-2] if bound.endswith(".0") else bound
        return f"{lead}must be {ranged.group(2)} {bound}; got {got!r}{note}"
    sized = re.match(r"Expected `([^`]+)` of length (>=|<=) (\d+)$", msg)
    if sized:
        return f"{lead}must be {_kind(sized.group(1))} of length {sized.group(2)} {sized.group(3)}; got {got!r}{note}"
    enum = re.match(r"Invalid enum value (.+)$", msg)
    if enum:
        lit = _literal_at(type_, parts)
        acc = f" one of {', '.join(map(str, lit))}" if lit else " one of the accepted values"
        return f"{lead}must be{acc}; got {enum.group(1)}{note}"
    own = re.match(r"^([A-Za-z_][\w-]*(?:\[\d+\])?)(\.[\w-]+)*: ", msg)
    if own:  # a __post_init__ check that names its field (the table may be a list item)
        table = _name([*parts, "_"], where)[0].removesuffix("_")
        return f"{table}{msg}"
    return f"{lead}{msg}{note}"


def _literal_at(type_: Any, parts: list[str | int]) -> tuple[Any, ...]:
    """The accepted values of the Literal field at ``parts``, in declaration order."""
    if isinstance(parts[-1] if parts else None, int):
        parts = parts[:-1]  # an item of a list of literals
    if not parts or not isinstance(parts[-1], str):
        return ()
    parent = _struct_at(type_, parts[:-1])
    if parent is None:
        return ()
    hint = typing.get_type_hints(parent.cls, include_extras=True).get(parts[-1])
    while hint is not None and typing.get_origin(hint) is not typing.Literal:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if args else None
    return typing.get_args(hint) if hint is not None else ()
