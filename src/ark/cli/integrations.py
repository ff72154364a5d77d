"""``ark preload`` (the connect() interposer that steers transfer engines' own connections) and
``ark serve-pd`` (a prefill/decode router in front of vLLM instances)."""

from __future__ import annotations

import os
import sys

import click

from ark.cli.common import err, out


@click.command("preload", context_settings={"ignore_unknown_options": True})
@click.option("--verbs", is_flag=True, help="The verbs interposer (RoCE QPs: ibv_modify_qp) instead of connect()'s.")
@click.option("--nccl", is_flag=True, help="With --verbs: name it in NCCL_IBVERBS_LIB (NCCL loads verbs through it) "
              "instead of LD_PRELOAD.")
@click.option("--cluster", "cluster_path", type=click.Path(dir_okay=False), show_default="none",
              help="Cluster TOML: with --host, check that this host's agent answers before COMMAND starts.")
@click.option("--host", show_default="none", help="This host's name in the cluster file.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def preload(verbs: bool, nccl: bool, cluster_path: str | None, host: str | None, command: tuple[str, ...]) -> None:
    """Print an interposer's path (building it on first use), or run COMMAND with it preloaded.

    The interposer steers nothing by itself: it binds the connections (or, with --verbs, sets
    the QPs' flow labels) that ARK's engine adapters ask for around each transfer, on ports of
    the path the local agent leased; everything else goes out as before. Before COMMAND
    starts, one line on stderr says so, and a warning when no agent answers (--cluster and
    --host name it).

    \b
    export LD_PRELOAD=$(ark preload)
    ark preload --cluster cluster.toml --host gpu0 -- python serve.py
    ark preload --verbs -- python serve.py          # RoCE QPs (Mooncake RDMA, UCX verbs)
    ark preload --verbs --nccl -- torchrun train.py # NCCL: NCCL_IBVERBS_LIB
    """
    if nccl and not verbs:
        raise click.UsageError("--nccl: only with --verbs (it names the verbs interposer for NCCL)")
    if (cluster_path is None) != (host is None):
        raise click.UsageError("--cluster and --host: give both (the agent to check) or neither")
    if verbs:
        from ark.integrations import verbs as v

        try:
            env = v.nccl_env() if nccl else v.preload_env()
        except v.VerbsError as e:
            raise click.ClickException(str(e)) from None
        path = env[v.NCCL_ENV] if nccl else env["LD_PRELOAD"].split()[0]
    else:
        from ark.integrations.preload import preload_env

        env = preload_env()
        path = env["LD_PRELOAD"].split()[0]
    if not command:
        out.print(path, highlight=False, soft_wrap=True)
        return
    what = ("the flow labels of RDMA queue pairs that ARK's verbs rules name (ark.integrations.verbs)" if verbs else
            "the TCP connections that ARK's engine adapters (ark.integrations.mooncake, ark.integrations.vllm) open "
            "inside a transfer")
    err.print(f"ark preload: {command[0]} runs with {path}: it steers {what} onto ports of the path the local agent "
              "leased; every other connection goes out as before", highlight=False, soft_wrap=True)
    warn = _agent_warning(cluster_path, host)
    if warn:
        err.print(f"ark preload: warning: {warn}", highlight=False, soft_wrap=True)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], list(command), env)
    except OSError as e:
        raise click.ClickException(f"{command[0]}: {e.strerror}") from None


def _agent_warning(cluster_path: str | None, host: str | None) -> str | None:
    """Why the engine's transfers may go out unsteered, or None when the named agent answers."""
    unsteered = "its transfers go out unsteered (plain ECMP) and each record says why"
    if cluster_path is None or host is None:
        return f"no agent named (--cluster FILE --host NAME), so none was checked; without one answering, {unsteered}"
    from ark.agent import cluster as clmod
    from ark.agent.client import ArkClient, ArkClientError

    api = clmod.load(cluster_path).host(host).api
    try:
        with ArkClient(api, timeout_s=1.0) as c:
            c.status()
    except ArkClientError as e:
        return f"no agent answers at {api} ({e}): until one does, {unsteered}"
    return None


@click.command("serve-pd")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False),
              help="TOML: [[prefill]] (url, engine_id, bootstrap) and [[decode]] (url) instances, mode.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the router listens on.")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True, help="Port the router listens on.")
def serve_pd(config_path: str, host: str, port: int) -> None:
    """A prefill/decode router: OpenAI completions in front of vLLM P and D instances."""
    import tomllib

    from ark.integrations.pdrouter import RouterError, load_config, serve

    try:
        with open(config_path, "rb") as f:
            raw = tomllib.load(f)
    except OSError as e:
        raise RouterError(f"config: cannot read {config_path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise RouterError(f"config: {config_path} is not valid TOML: {e}") from None
    cfg = load_config(raw)
    out.print(f"P/D router on http://{host}:{port}: {len(cfg.prefill)} prefill, {len(cfg.decode)} decode, "
              f"{cfg.mode}", highlight=False)
    serve(cfg, host, port)
