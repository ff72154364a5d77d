"""``ark pathmap``: which source ports the switch hash sends over each path."""

from __future__ import annotations

import json

import click
from rich.table import Table

from ark.cli.common import OutFile, err, out
from ark.core.hashing import HASH_MODELS
from ark.core.pathmap import MAX_PATHS, PathMapError, compute_buckets, parse_port_range
from ark.core.topology import HASH_SELECTIONS


@click.command()
@click.option("--hash", "hash_name", type=click.Choice(list(HASH_MODELS)), required=True, help="Switch hash model.")
@click.option("--seed", type=click.IntRange(0, 2**32 - 1), default=0, show_default=True, help="Switch hash seed.")
@click.option("--src", required=True, help="Source IPv4 address.")
@click.option("--dst", required=True, help="Destination IPv4 address.")
@click.option("--dport", type=click.IntRange(0, 65535), default=4791, show_default=True,
              help="Destination port (4791: RoCEv2); the hash includes it.")
@click.option("--paths", type=click.IntRange(min=1), required=True,
              help="Equal-cost next hops K (at most the ports in --port-range).")
@click.option("--port-range", default="49152-65535", show_default=True, help="Source ports LO-HI.")
@click.option("--selection", type=click.Choice(list(HASH_SELECTIONS)), default="modulo", show_default=True,
              help="How the hash picks a next hop: modulo (hash mod K) or threshold (hash-threshold, as Linux).")
@click.option("--proto", type=click.IntRange(0, 255), default=17, show_default=True, help="IP protocol (17 UDP/RoCEv2, 6 TCP).")
@click.option("--json", "as_json", is_flag=True, help="Print every port per path as JSON.")
@click.option("--save", type=OutFile(), show_default="none",
              help="Also write the map file an agent loads (cluster pathmap_dir).")
def pathmap(
    hash_name: str, seed: int, src: str, dst: str, dport: int, paths: int, port_range: str,
    selection: str, proto: int, as_json: bool, save: str | None,
) -> None:
    """Which source ports the switch hash sends over each path."""
    try:
        rng = parse_port_range(port_range)
    except PathMapError as e:
        raise click.BadParameter(str(e).removeprefix("port-range: "), param_hint="--port-range") from None
    most = min(rng[1] - rng[0] + 1, MAX_PATHS)
    if paths > most:
        raise click.BadParameter(f"must be 1..{most} (each path needs a source port of {rng[0]}-{rng[1]}, and a map "
                                 f"holds at most {MAX_PATHS}); got {paths}", param_hint="--paths")
    try:
        pm = compute_buckets(hash_name, seed, src, dst, dport, paths, rng, selection, proto)
    except PathMapError as e:
        what, _, msg = str(e).partition(": ")
        raise click.BadParameter(msg, param_hint=f"--{what}") from None
    empty = sum(1 for b in pm.buckets if len(b) == 0)
    if empty:
        err.print(f"ark: warning: {empty} of {paths} paths got no source port of {rng[0]}-{rng[1]} (the hash spreads "
                  f"{rng[1] - rng[0] + 1} ports over {paths} paths): a flow cannot be steered onto them",
                  highlight=False, soft_wrap=True)
    if save:
        pm.save(save)
    if as_json:
        click.echo(json.dumps({
            "hash": hash_name, "seed": seed, "paths": paths,
            "ports": {str(k): b.tolist() for k, b in enumerate(pm.buckets)},
        }))
        return
    t = Table(title=f"{hash_name} seed={seed} {src} -> {dst}:{dport} ports {rng[0]}-{rng[1]} ({selection})")
    t.add_column("path", justify="right")
    t.add_column("ports", justify="right")
    t.add_column("share", justify="right")
    t.add_column("first ports")
    total = sum(pm.counts())
    for k, b in enumerate(pm.buckets):
        t.add_row(str(k), str(len(b)), f"{100 * len(b) / total:.1f}%", ",".join(map(str, b[:5].tolist())))
    out.print(t)

