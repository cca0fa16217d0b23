#!/usr/bin/env bash
# Set up foretell in ./.venv: torch first (the CPU build on a machine without an NVIDIA GPU,
# so pip never pulls a multi-GB CUDA build there), the draft cache's suffix trees built against
# it, then foretell with its proxy, draft-cache, ray (--replicas) and dev extras.
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
    "$py" -m pip install --no-compile --quiet --disable-pip-version-check "$torch_spec"
fi

# The draft cache's suffix trees (arctic-inference, the `draft-cache` extra) build from source
# against this torch: its build tools first, then the build with isolation off, so no isolated build
# environment fetches a CUDA torch. pip keeps the built wheel in its cache for later setups.
if ! "$py" -c "import arctic_inference.suffix_decoding" 2>/dev/null; then
    echo "foretell setup: building arctic-inference (the draft cache's suffix trees; about a minute)" >&2
    "$py" -m pip install --no-compile --quiet --disable-pip-version-check setuptools wheel ninja "cmake>=3.18" \
        nanobind==2.9.2 protobuf==5.29.6 grpcio-tools numpy
    CMAKE_ARGS="-DPython_EXECUTABLE=$(cd .venv/bin && pwd)/python" \
        "$py" -m pip install --no-compile --quiet --disable-pip-version-check --no-build-isolation --no-deps \
        arctic-inference==0.3.0
    # A build tool only, whose protobuf pin (<6) Ray Serve's gRPC parts outgrow.
    "$py" -m pip uninstall --quiet --yes grpcio-tools
fi

echo "foretell setup: installing foretell[proxy,draft-cache,ray,dev]" >&2
"$py" -m pip install --no-compile --quiet --disable-pip-version-check -e ".[proxy,draft-cache,ray,dev]"
# The native CPU loops of the batch-invariant precisions (foretell/kernels/*.cpp),
# compiled once per CPU and torch into the foretell cache folder, so no server start waits for it.
echo "foretell setup: building the native CPU loops (once per CPU and torch)" >&2
"$py" -m foretell.kernels.cpu_native \
    || echo "foretell setup: a native CPU loop did not build; torch operations serve instead" >&2
# Byte-compile here rather than in pip (--no-compile above): pip compiles one file at a time,
# compileall on every core, which takes ~20 s off a fresh setup on two cores. foretell's own
# sources too: an editable install is not compiled, and where PYTHONDONTWRITEBYTECODE is set no
# process would ever write them. A source edited later is simply compiled again on import. A
# file that fails (torch ships test files for newer Pythons) is skipped, as pip skips it.
echo "foretell setup: byte-compiling" >&2
"$py" -m compileall -q -j 0 "$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    foretell proxy sdk harness >/dev/null || true
echo "foretell setup: done (.venv/bin/foretell)" >&2
