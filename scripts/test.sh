#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite on CPU. The first run converts the embedded
# model once (~1 minute) and caches it under ~/.cache/foretell.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The playground's browser tests drive the system Chromium (Debian's chromium package; Playwright's
# own browser download is never used). Installed here when missing and we can; otherwise those
# tests fail, saying what is missing.
if [ ! -x "${FORETELL_CHROMIUM:-/usr/bin/chromium}" ]; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        echo "foretell test: installing Debian's chromium for the browser tests" >&2
        apt-get update -q >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null
    else
        echo "foretell test: no Chromium at ${FORETELL_CHROMIUM:-/usr/bin/chromium} (install Debian's " \
             "chromium package, or set FORETELL_CHROMIUM): the browser tests will fail" >&2
    fi
fi
export HF_HUB_OFFLINE=1
# Two phases. First everything but the Ray tests on two workers (pytest-xdist), whole test files
# to a worker so that a module's server or model is built once (FORETELL_TEST_WORKERS=0 runs them
# in this process; so does -n 0 after it). Then the Ray tests alone, once those workers have
# exited: a Ray cluster of two replicas next to two busy workers holding their session's models
# ran this 24 GiB machine out of memory (the kernel killed a replica or a worker). The phase is a
# deselection in tests/conftest.py (FORETELL_TEST_PHASE), so that a -m of the caller's still
# applies in both. Arguments go to both phases; a phase that selects no test (pytest's exit
# code 5) is not a failure.
workers="${FORETELL_TEST_WORKERS:-2}"
status=0
FORETELL_TEST_PHASE=not-ray .venv/bin/python -m pytest -n "$workers" --dist loadfile "$@" || status=$?
[ "$status" = 5 ] && status=0
ray_status=0
FORETELL_TEST_PHASE=ray .venv/bin/python -m pytest -n 0 "$@" || ray_status=$?
[ "$ray_status" = 5 ] && ray_status=0
[ "$status" != 0 ] && exit "$status"
exit "$ray_status"
