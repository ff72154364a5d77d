#!/usr/bin/env bash
# NIXL for ARK's NIXL runner (ark.testbed.nixl) and its tests, into the project's virtual
# environment: scripts/install-nixl.sh [VENV] (default .venv). The `nixl` extra pins nixl and
# nixl-cu12 1.5.1; nixl-cu12 requires torch, which a DRAM-to-DRAM transfer never imports
# (nixl imports torch only when handed tensors), so both wheels go in without their
# requirements; numpy, the one they use, comes with ARK itself. The wheel bundles UCX 1.23.0
# and links no CUDA library: UCX_TLS=tcp runs on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
[ -x "$venv/bin/pip" ] || python3 -m venv "$venv"
# The pins are the `nixl` extra's (pyproject.toml), read rather than written again here.
mapfile -t pins < <(python3 -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['nixl']))")
"$venv/bin/pip" install -q --no-deps "${pins[@]}"
"$venv/bin/python" -c "import numpy; from nixl._api import nixl_agent, nixl_agent_config"
echo "install-nixl: $venv ready (nixl $("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("nixl-cu12"))'))"
