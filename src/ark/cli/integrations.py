"""``ark preload``: the connect() interposer that steers transfer engines' own connections."""

from __future__ import annotations

import os
import sys

import click

from ark.cli.common import out


@click.command("preload", context_settings={"ignore_unknown_options": True})
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def preload(command: tuple[str, ...]) -> None:
    """Print the interposer's path (building it on first use), or run COMMAND with it preloaded.

    \b
    export LD_PRELOAD=$(ark preload)
    ark preload -- python serve.py
    """
    from ark.integrations.preload import preload_env

    env = preload_env()
    if not command:
        out.print(env["LD_PRELOAD"].split()[0], highlight=False, soft_wrap=True)
        return
    sys.stdout.flush()
    try:
        os.execvpe(command[0], list(command), env)
    except OSError as e:
        raise click.ClickException(f"{command[0]}: {e.strerror}") from None
