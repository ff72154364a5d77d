"""The ``ark`` command line: the only layer that prints, plots and writes files.

One module per command group; this one assembles them and turns every user error into
one line on stderr.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import click

from ark.agent.client import ArkClientError
from ark.agent.incarnation import IncarnationError
from ark.agent.probe import ProbeError
from ark.agent.sockets import AgentError
from ark.cli import (
    agent,
    bench,
    compare,
    experiment,
    integrations,
    pathmap,
    polarisation,
    racewindow,
    sweep,
    testbed,
)
from ark.cli.common import InOrder, err
from ark.core.hashing import HashError
from ark.core.pathmap import PathMapError
from ark.core.protocol import CoreError
from ark.core.schema import ConfigError
from ark.core.topology import TopologyError
from ark.integrations.preload import PreloadError
from ark.sim.engine import SimError
from ark.sim.failure import FailureError
from ark.sim.sweep import SweepError
from ark.sim.workload import WorkloadError
from ark.testbed.fabric import TestbedError

USER_ERRORS = (
    ConfigError, PathMapError, HashError, TopologyError, WorkloadError, SimError, CoreError,
    ArkClientError, TestbedError, ProbeError, PreloadError, SweepError, FailureError, AgentError, IncarnationError,
)


@click.group(cls=InOrder, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ark-fabric", prog_name="ark")
def cli() -> None:
    """ARK: host-side path reservation for KV-cache flows on ECMP fabrics."""


# In the order a user meets them: the experiment and the decision, path maps, agents on
# loopback, the testbed, engines, then sweeps, deployment and benchmarks.
for command in (
    experiment.reproduce, compare.compare, experiment.simulate, pathmap.pathmap, agent.cluster_cmd,
    testbed.testbed, integrations.preload, sweep.sweep, racewindow.race_window, polarisation.polarisation,
    agent.keygen, agent.agent, agent.arbiter, agent.status, agent.ports, agent.probe_cmd, integrations.serve_pd,
    bench.bench,
):
    cli.add_command(command)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: every user error becomes one line on stderr and a non-zero exit."""
    try:
        rv = cli.main(args=list(argv) if argv is not None else None, prog_name="ark", standalone_mode=False)
    except click.exceptions.Exit as e:
        return int(e.exit_code)
    except click.Abort:
        err.print("aborted", highlight=False)
        return 130
    except click.ClickException as e:
        click.echo(f"ark: error: {e.format_message()}", err=True)
        return e.exit_code if e.exit_code else 2
    except USER_ERRORS as e:
        click.echo(f"ark: error: {e}", err=True)
        return 2
    except BrokenPipeError:
        return 0
    return rv if isinstance(rv, int) else 0


if __name__ == "__main__":
    sys.exit(main())
