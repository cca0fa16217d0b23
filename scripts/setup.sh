#!/usr/bin/env bash
# Set up foretell in ./.venv: torch first (the CPU build on a machine without an NVIDIA GPU,
# so pip never pulls a multi-GB CUDA build there), then foretell with its proxy and dev extras.
# Safe to run again: an existing venv and an installed torch are kept.
set -euo pipefail
cd "$(dirname "$0")/.."

python_bin=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "foretell setup: creating .venv with $($python_bin --version)" >&2
    "$python_bin" -m venv .venv
fi
py=.venv/bin/python

if ! "$py" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        torch_spec=${FORETELL_TORCH_SPEC:-torch}          # CUDA build from the package index
    else
        torch_spec=${FORETELL_TORCH_SPEC:-torch==2.13.0}  # the CPU build on this kind of machine
    fi
    echo "foretell setup: installing $torch_spec" >&2
    "$py" -m pip install --quiet --disable-pip-version-check "$torch_spec"
fi

echo "foretell setup: installing foretell[proxy,dev]" >&2
"$py" -m pip install --quiet --disable-pip-version-check -e ".[proxy,dev]"
echo "foretell setup: done (.venv/bin/foretell)" >&2
