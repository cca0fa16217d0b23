"""``foretell edit`` as a subprocess against a live ``foretell serve`` with the embedded model
(tests/e2e/conftest.py): what it prints, --diff, --write, and an edit cut off by --max-tokens."""

from __future__ import annotations

import pytest

from foretell.sdk import Client, edit
from tests.e2e.test_sdk_live import FILE, INSTRUCTION, MODEL
from tests.sdk.test_cli_edit import leftovers, run_edit


@pytest.fixture(scope="module")
def expected(embedded_server):
    with Client(embedded_server, max_retries=0, timeout=300) as client:
        return edit(client, FILE, INSTRUCTION, model=MODEL, filename="shapes.py")


@pytest.mark.embedded
def test_edit_prints_the_new_file_and_statistics(tmp_path, embedded_server, expected):
    path = tmp_path / "shapes.py"
    path.write_text(FILE)
    # No --model: the first model the server lists; the base URL from the environment.
    result = run_edit(str(path), "--instruction", INSTRUCTION, env_extra={"FORETELL_BASE_URL": embedded_server})
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected.text
    stats = result.stderr.strip().splitlines()[-1]
    assert stats.startswith("foretell edit: ") and "tok/s" in stats and "prediction tokens:" in stats
    assert path.read_text() == FILE  # no --write: untouched


@pytest.mark.embedded
def test_edit_diff_and_write(tmp_path, embedded_server, expected):
    path = tmp_path / "shapes.py"
    path.write_text(FILE)
    instruction_file = tmp_path / "instruction.txt"
    instruction_file.write_text(INSTRUCTION)
    diff = run_edit(str(path), "--instruction-file", str(instruction_file), "--diff",
                    "--base-url", embedded_server, "--model", MODEL)
    assert diff.returncode == 0, diff.stderr
    assert diff.stdout == expected.diff
    written = run_edit(str(path), "-i", INSTRUCTION, "--write", "--base-url", embedded_server, "--model", MODEL)
    assert written.returncode == 0, written.stderr
    assert path.read_text() == expected.text and written.stdout == ""
    assert leftovers(tmp_path) == []


@pytest.mark.embedded
def test_an_edit_cut_off_by_max_tokens_is_refused(tmp_path, embedded_server):
    path = tmp_path / "shapes.py"
    path.write_text(FILE)
    result = run_edit(str(path), "-i", INSTRUCTION, "--write", "--max-tokens", "5",
                      "--base-url", embedded_server, "--model", MODEL)
    assert result.returncode == 1
    assert "was not changed" in result.stderr and "Traceback" not in result.stderr
    assert path.read_text() == FILE
