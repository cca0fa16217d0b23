#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite on CPU. The first run converts the embedded
# model once (~1 minute) and caches it under ~/.cache/foretell.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
exec .venv/bin/python -m pytest "$@"
