#!/usr/bin/env bash
# Create the virtual environment the TRL side of the throughput benchmark runs in.
#
# TRL pins its own stack, so it gets a venv of its own (benchmarks/.venv-trl, git-ignored) and never
# touches the project's environment. trl 0.29 asks for transformers>=4.56.2; we pin the SAME
# transformers and torch as the project, so the comparison measures the two trainers, not two
# library versions. `torch==2.13.0` resolves to the CPU build on this machine's local wheel store.
#
#   bash benchmarks/setup_trl_venv.sh            # creates or updates benchmarks/.venv-trl
#   TRL_VENV=/elsewhere bash benchmarks/setup_trl_venv.sh
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${TRL_VENV:-$here/.venv-trl}"
transformers_version="$(python3 -c 'import transformers; print(transformers.__version__)')"
torch_version="$(python3 -c 'import torch; print(torch.__version__.split("+")[0])')"

python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet \
    "torch==$torch_version" \
    "trl==0.29.*" \
    "transformers==$transformers_version" \
    psutil
"$venv/bin/python" -c 'import trl, transformers, torch; print(f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__} in '"$venv"'")'
