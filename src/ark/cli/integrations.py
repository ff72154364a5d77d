"""``ark preload`` (the connect() interposer that steers transfer engines' own connections) and
``ark serve-pd`` (a prefill/decode router in front of vLLM instances)."""

from __future__ import annotations

import os
import sys

import click

from ark.cli.common import out


@click.command("preload", context_settings={"ignore_unknown_options": True})
@click.option("--verbs", is_flag=True, help="The verbs interposer (RoCE QPs: ibv_modify_qp) instead of connect()'s.")
@click.option("--nccl", is_flag=True, help="With --verbs: name it in NCCL_IBVERBS_LIB (NCCL loads verbs through it) "
              "instead of LD_PRELOAD.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def preload(verbs: bool, nccl: bool, command: tuple[str, ...]) -> None:
    """Print an interposer's path (building it on first use), or run COMMAND with it preloaded.

    \b
    export LD_PRELOAD=$(ark preload)
    ark preload -- python serve.py
    ark preload --verbs -- python serve.py          # RoCE QPs (Mooncake RDMA, UCX verbs)
    ark preload --verbs --nccl -- torchrun train.py # NCCL: NCCL_IBVERBS_LIB
    """
    if nccl and not verbs:
        raise click.UsageError("--nccl: only with --verbs (it names the verbs interposer for NCCL)")
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
    sys.stdout.flush()
    try:
        os.execvpe(command[0], list(command), env)
    except OSError as e:
        raise click.ClickException(f"{command[0]}: {e.strerror}") from None


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
