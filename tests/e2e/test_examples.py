"""Every example in examples/ runs against a live `foretell serve` (embedded model)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.embedded

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str, base_url: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FORETELL_", "OPENAI_"))}
    result = subprocess.run([sys.executable, str(EXAMPLES / name), "--base-url", base_url],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.parametrize("name", ["sdk_edit.py", "openai_edit.py"])
def test_edit_examples_accept_prediction_tokens(embedded_server, name):
    out = run_example(name, embedded_server)
    accepted = re.search(r"prediction tokens: (\d+) accepted, (\d+) rejected", out)
    assert accepted and int(accepted.group(1)) > 0, out
    assert re.search(r"target passes: \d+ for \d+ tokens", out), out


def test_rag_summary_drafts_from_the_prompt(embedded_server):
    out = run_example("rag_summary.py", embedded_server)
    assert re.search(r"^answer: \S", out, re.MULTILINE), out
    lookup = re.search(r"prompt lookup: drafted (\d+), accepted (\d+)", out)
    assert lookup and int(lookup.group(2)) > 0, out


def test_async_batch_edits_finishes_every_edit(embedded_server):
    out = run_example("async_batch_edits.py", embedded_server)
    assert "3 of 3 edits done" in out, out
    assert len(re.findall(r"prediction tokens accepted", out)) == 3
