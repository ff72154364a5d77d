#!/usr/bin/env python3
"""The RoCEv2 wire check as a script: ``ark testbed roce-check`` (see its --help and
docs/engines/roce.md). Run it as root with the project's Python, on a 2-tier testbed:

    sudo .venv/bin/ark testbed up
    sudo .venv/bin/python scripts/roce-wire-check.py [--per-spine 2] [--json]
"""

import sys

from ark.cli import main

if __name__ == "__main__":
    sys.exit(main(["testbed", "roce-check", *sys.argv[1:]]))
