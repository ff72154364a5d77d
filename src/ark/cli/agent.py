"""Agent commands: ``ark agent``, ``keygen``, ``status``, ``ports`` and ``cluster``."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import click
from rich.table import Table

from ark.cli.common import FiniteRange, OutFolder, out


def _cluster(path: str) -> Any:
    from ark.agent import cluster as clmod

    return clmod.load(path)


def _daemon_options(f: Callable[..., None]) -> Callable[..., None]:
    """The options every long-running process takes: its cluster file, key and log level."""
    for opt in reversed((
        click.option("--cluster", "cluster_path", required=True, type=click.Path(dir_okay=False), help="Cluster TOML."),
        click.option("--secret-key", type=click.Path(dir_okay=False),
                     show_default="from the cluster file", help="CURVE secret key file."),
        click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
                     show_default=True, help="Least severe log records written."),
    )):
        f = opt(f)
    return f


@click.command()
@_daemon_options
@click.option("--host", required=True, help="This host's name in the cluster file.")
def agent(cluster_path: str, host: str, secret_key: str | None, log_level: str) -> None:
    """Run this host's ARK agent (JSON logs on stderr)."""
    from ark.agent.daemon import run_agent

    run_agent(_cluster(cluster_path), host, secret_key, log_level)


@click.command("arbiter")
@_daemon_options
@click.option("--name", required=True, help="This arbiter's name in the cluster file's [[arbiters]].")
def arbiter(cluster_path: str, name: str, secret_key: str | None, log_level: str) -> None:
    """Run an ARK arbiter: decides for every host with one table (JSON logs on stderr)."""
    from ark.agent.arbiter import run_arbiter

    run_arbiter(_cluster(cluster_path), name, secret_key, log_level)


@click.command()
@click.option("--out", "out_dir", type=OutFolder(), default="keys", show_default=True,
              help="Folder for the key files (created).")
@click.option("--name", required=True, help="Key name (usually the host name): letters, digits, '.', '_', '-'.")
def keygen(out_dir: str, name: str) -> None:
    """Write a CURVE key pair: NAME.key (public) and NAME.key_secret."""
    import re

    from ark.agent.keys import create_keypair

    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}", name):
        raise click.BadParameter(f"expected 1-64 letters, digits, '.', '_' or '-' (a file name); got {name!r}",
                                 param_hint="--name")
    kp = create_keypair(out_dir, name)
    out.print(f"public_key = \"{kp.public_key}\"\nsign_key = \"{kp.sign_key}\"\n# secret: {kp.secret_file}",
              highlight=False)


def _client_for(cluster_path: str, host: str) -> Any:
    from ark.agent.client import ArkClient

    return ArkClient(_cluster(cluster_path).host(host).api, timeout_s=2.0)


@click.command()
@click.option("--cluster", "cluster_path", required=True, type=click.Path(dir_okay=False), help="Cluster TOML.")
@click.option("--host", required=True, help="The host (its name in the cluster file) whose agent to ask.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of a table.")
def status(cluster_path: str, host: str, as_json: bool) -> None:
    """This host's view: peers up or down, reserved links, counters."""
    from ark.agent.client import ArkClientError

    with _client_for(cluster_path, host) as c:
        try:
            st = c.status()
        except ArkClientError as e:
            raise click.ClickException(f"agent {host}: {e}") from None
    if as_json:
        click.echo(json.dumps(st, indent=1))
        return
    out.print(f"[bold]{st['name']}[/] (id {st['host']}, incarnation {st['incarnation']}): "
              f"{'ready' if st['ready'] else 'resynchronising'}; {st['reservations']} reservations, "
              f"{len(st['reserved_links'])} reserved links, {st['local_flows']} local flows, digest {st['digest']}")
    t = Table(title="peers")
    for col in ("peer", "up", "synced", "last heard (s ago)", "last seq"):
        t.add_column(col)
    for name, p in st["peers"].items():
        t.add_row(name, "up" if p["up"] else "[red]down[/]", str(p["synced"]), str(p["last_heard_s_ago"]), str(p["last_seq"]))
    out.print(t)
    t = Table(title="counters")
    t.add_column("counter")
    t.add_column("value", justify="right")
    for k, v in {**st["core"], **st["node"]}.items():
        t.add_row(k, str(v))
    out.print(t)


@click.command()
@click.option("--cluster", "cluster_path", type=click.Path(dir_okay=False), show_default="none (needed unless --engines)",
              help="Cluster TOML.")
@click.option("--host", show_default="none (needed unless --engines)", help="This host.")
@click.option("--peer", show_default="none (needed unless --engines)", help="Destination host.")
@click.option("--dport", type=click.IntRange(0, 65535), default=None, show_default="the cluster's", help="Destination port.")
@click.option("--engines", is_flag=True, help="Only say what each transfer engine can take (no cluster needed).")
@click.option("--roce", is_flag=True,
              help="Per path, the ports a RoCEv2 flow label reaches (0xC000-0xFFFF) and the label of each.")
@click.option("--limit", type=click.IntRange(1), default=8, show_default=True, help="--roce: ports shown per path.")
@click.option("--json", "as_json", is_flag=True, help="--roce: every port and label, as JSON.")
def ports(cluster_path: str | None, host: str | None, peer: str | None, dport: int | None, engines: bool,
          roce: bool, limit: int, as_json: bool) -> None:
    """One source port per path from HOST to PEER, comma-separated; and what engines can take.

    No engine takes a per-peer or per-transfer port list today. Mooncake's MC_MLX5_QP_UDP_SPORTS
    is one process-wide list (QP i of every peer's endpoint gets list[i % n]), read only by
    source builds with USE_MLX5DV=ON; its TCP transport is steered per transfer by
    ark.integrations.mooncake, and RDMA engines' QPs by the verbs interposer
    (ark.integrations.verbs, flow labels: `--roce`). `--engines` prints the whole table.
    """
    if engines:
        _engine_table()
        return
    missing = [o for o, v in (("--cluster", cluster_path), ("--host", host), ("--peer", peer)) if v is None]
    if missing:
        raise click.UsageError(f"{', '.join(missing)}: required (or --engines)")
    cl = _cluster(str(cluster_path))
    me, other = cl.host(str(host)), cl.host(str(peer))
    d = cl.dport if dport is None else dport
    pm = cl.pathmaps()(me.index, other.index, d)
    if roce:
        _roce_ports(pm, f"{host} to {peer} (dport {d})", limit, as_json)
        return
    click.echo(",".join(str(p) for p in pm.static_ports() if p >= 0))
    click.echo(f"one source port per path from {host} to {peer} (dport {d}), for this peer only. Mooncake RDMA: "
               "MC_MLX5_QP_UDP_SPORTS is one process-wide list, QP i of every peer's endpoint gets list[i % n], "
               "read only by source builds with USE_MLX5DV=ON; no engine takes a per-transfer port today except "
               "Mooncake TCP through ark.integrations.mooncake. See `ark ports --engines`.", err=True)


def _roce_ports(pm: Any, what: str, limit: int, as_json: bool) -> None:
    """Per path, its ports a GRH flow label reaches and their labels (``rdma_flow_label_to_udp_sport``'s inverse)."""
    from ark.core.roce import ROCE_SPORT_MAX, ROCE_SPORT_MIN, flow_label_for_sport

    lo, hi = pm.port_range
    if hi < ROCE_SPORT_MIN:
        raise click.ClickException(f"port_range: {lo}-{hi} holds no port {ROCE_SPORT_MIN}-{ROCE_SPORT_MAX}, the only "
                                   "ones a RoCEv2 flow label reaches")
    paths = [[int(p) for p in b if p >= ROCE_SPORT_MIN] for b in pm.buckets]
    if as_json:
        click.echo(json.dumps({"src": pm.src_ip, "dst": pm.dst_ip, "dport": pm.dport, "probed": pm.sampled,
                               "port_range": [max(lo, ROCE_SPORT_MIN), hi],
                               "paths": [{"path": k, "ports": ps, "flow_labels": [flow_label_for_sport(p) for p in ps]}
                                         for k, ps in enumerate(paths)]}))
        return
    t = Table(title=f"RoCEv2 source ports per path from {what}: ports {max(lo, ROCE_SPORT_MIN)}-{hi}"
                    + (" (probed ports only)" if pm.sampled else ""))
    for col in ("path", "ports", "port (flow label)"):
        t.add_column(col, overflow="fold")
    for k, ps in enumerate(paths):
        shown = ", ".join(f"{p} (0x{flow_label_for_sport(p):05x})" for p in ps[:limit])
        t.add_row(str(k), str(len(ps)), shown + (", ..." if len(ps) > limit else "") or "none")
    out.print(t)
    out.print("A QP given the flow label at INIT -> RTR sends from that port (Linux rdma_get_udp_sport: mlx5 since "
              "5.8, rxe, irdma, hns since 2022). The verbs interposer sets it for engines "
              "(`python -m ark.integrations.verbs -- CMD`); see docs/engines/roce.md.", highlight=False)


def _engine_table() -> None:
    from rich.markup import escape

    from ark.integrations.catalog import ENGINES

    t = Table(title="what each transfer engine lets a caller choose about source ports", show_lines=True)
    # A setting is copied as it is: wide enough that no name of one is cut in two.
    widest = max(len(w) for e in ENGINES for w in e.knob.replace(",", " ").split())
    for col in ("engine", "transport", "setting", "applies to", "ARK today (checked how; kernel and driver)",
                "grain", "per-transfer steering needs"):
        t.add_column(col, overflow="fold", min_width=widest + 1 if col == "setting" else None)
    for e in ENGINES:
        today = e.ark_today + (f" (checked: {e.verified})" if e.verified else "")
        today += f" (needs: {e.conditions})" if e.conditions else ""
        t.add_row(*(escape(v) for v in (e.engine, e.transport, e.knob, e.scope, today, e.grain,
                                        e.per_transfer_needs)))
    out.print(t)


@click.command("cluster")
@click.option("--agents", type=click.IntRange(2, 64), default=16, show_default=True, help="Agent processes started.")
@click.option("--flows", type=click.IntRange(min=1), default=5000, show_default=True, help="Reserve+release cycles.")
@click.option("--kill", type=click.IntRange(min=0), default=0, show_default=True, help="Agents to SIGKILL halfway and restart.")
@click.option("--lease", "lease_min_s", type=FiniteRange(min=0.1), default=1.0, show_default=True, help="Minimum lease (s).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the flows' hosts and sizes.")
@click.option("--hog", "hogs", type=click.IntRange(0, 64), default=0, show_default=True,
              help="Busy processes beside the agents all along (an overloaded host).")
@click.option("--control", type=click.Choice(["broadcast", "arbiter"]), default="broadcast", show_default=True,
              help="arbiter: the agents ask a primary and a standby arbiter, and the primary is SIGKILLed halfway.")
@click.option("--takeover", "takeover_s", type=FiniteRange(min=0.1, max=60), default=1.0, show_default=True,
              help="Arbiter mode: the standby leads after this much silence (s).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of a table.")
def cluster_cmd(agents: int, flows: int, kill: int, lease_min_s: float, seed: int, hogs: int, control: str,
                takeover_s: float, as_json: bool) -> None:
    """Start N real agents on loopback, drive reserve/release cycles, report."""
    from ark.agent.loopback import run_cluster

    if kill >= agents:
        raise click.BadParameter(f"must be below --agents ({agents})", param_hint="--kill")
    if control == "arbiter":
        if kill or hogs:
            raise click.BadParameter("not with --control arbiter (its primary arbiter is what is killed)",
                                     param_hint="--kill/--hog")
        from ark.agent.arbiter_run import run_arbiter_cluster

        res = run_arbiter_cluster(agents, flows, seed=seed, lease_min_s=lease_min_s, takeover_s=takeover_s)
        title = f"{agents} agents asking 2 arbiters on loopback, {flows} any-to-any cycles, primary SIGKILLed halfway"
    else:
        res = run_cluster(agents, flows, kill, seed=seed, lease_min_s=lease_min_s, hogs=hogs)
        title = f"{agents} agents on loopback, {flows} reserve+release cycles, {kill} killed"
    if as_json:
        click.echo(json.dumps(res, indent=1))
        return
    t = Table(title=title)
    t.add_column("measure")
    t.add_column("value", justify="right")
    for k, v in res.items():
        t.add_row(k, str(v))
    out.print(t)
    out.print(cluster_verdict(res), highlight=False, soft_wrap=True)


# What a cluster run must show to pass, with the way each failure reads.
_MUST = (("client_errors", 0, "client errors"), ("invalid_messages", 0, "invalid messages"),
         ("leaked", 0, "leaked reservations"), ("digest_mismatches", 0, "digest mismatches"),
         ("held_leases_lapsed", 0, "held leases lapsed"))


def cluster_verdict(res: dict[str, Any]) -> str:
    """One line: PASS or FAIL, and what the counters mean (races are expected, not faults)."""
    bad = [f"{res[k]} {what}" for k, want, what in _MUST if k in res and res[k] != want]
    if "digests_equal" in res and not res["digests_equal"]:
        bad.append("tables differ at the end")
    if res.get("killed") and res.get("dead_reservations_cleared_s") is None:
        bad.append("the killed agents' reservations were never cleared")
    if "flows" in res and "flows_requested" in res and res["flows"] != res["flows_requested"]:
        bad.append(f"{res['flows']} of {res['flows_requested']} cycles done")
    done = res.get("flows", res.get("cycles", "?"))
    line = [f"verdict: {'FAIL: ' + ', '.join(bad) if bad else 'PASS'}: {done} reserve+release cycles through "
            f"{res.get('agents', '?')} real agents"]
    if "races" in res:
        line.append(f"{res['races']} races (two agents took one path within the broadcast window; each resolved by "
                    "(timestamp, host id), the loser re-pathed), not faults")
    if res.get("killed"):
        line.append(f"killed agents' reservations gone everywhere {res['dead_reservations_cleared_s']} s after the "
                    f"kill (lease {res.get('lease_period_s')} s, then a 50 ms grace and tick)")
    if not bad:
        line.append("no client error, invalid message or leak; every table equal at the end")
    return "; ".join(line)


@click.command("probe")
@click.option("--cluster", "cluster_path", type=click.Path(dir_okay=False), required=True, help="Cluster TOML.")
@click.option("--host", required=True, help="This host's name in the cluster file.")
@click.option("--peers", show_default="peers already probed, else every host behind another leaf", help="Comma-separated peer names.")
@click.option("--routers", type=click.Path(dir_okay=False), show_default="the cluster's routers_file", help="JSON: router (spine) address -> path index.")
@click.option("--sample", type=click.IntRange(min=0), show_default="the cluster's probe_sample", help="Source ports probed per peer per round; 0: all.")
@click.option("--proto", type=click.Choice(["tcp", "udp"]), show_default="the cluster's probe_proto", help="Probe with your flows' protocol: the ECMP hash includes it.")
@click.option("--dport", type=click.IntRange(0, 65535), show_default="the cluster's dport",
              help="Destination port to probe (the hash includes it).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of a table.")
def probe_cmd(cluster_path: str, host: str, peers: str | None, routers: str | None, sample: int | None,
              proto: str | None, dport: int | None, as_json: bool) -> None:
    """Learn this host's path maps by TTL-limited probes and write them to the cluster's pathmap_dir."""
    import msgspec

    from ark.agent import cluster as clmod
    from ark.agent.probe import refresh

    c = clmod.load(cluster_path)
    if c.pathmap_dir is None:
        raise clmod.ClusterError("cluster.pathmap_dir: required to store probed maps")
    c.host(host)
    over: dict[str, Any] = {}
    if routers is not None:
        over["routers_file"] = routers
    if sample is not None:
        over["probe_sample"] = sample
    if proto is not None:
        over["probe_proto"] = proto
    if dport is not None:
        over["dport"] = dport
    c = msgspec.structs.replace(c, **over)
    names = [p for p in peers.split(",") if p] if peers else None
    summary = refresh(c, host, names)
    if as_json:
        click.echo(json.dumps(summary))
        return
    t = Table(title=f"{host}: probed path maps ({c.probe_proto})")
    for col in ("peer", "probes", "answered", "seconds", "ports per path"):
        t.add_column(col)
    for peer, s in summary.items():
        t.add_row(peer, str(s["probes_sent"]), str(s["answered"]), f"{s['seconds']:.3f}", str(s["ports_per_path"]))
    out.print(t)
