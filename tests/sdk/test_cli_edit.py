"""``foretell edit``: the atomic write offline, the command as a subprocess (errors offline, edits
against the live server)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from foretell.cli import FileChangedError, _edit_stats, write_atomically
from foretell.sdk import Client, EditResult, edit, unified_diff
from tests.sdk.conftest import free_port
from tests.sdk.test_live import FILE, INSTRUCTION, MODEL


def run_edit(*args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FORETELL_", "OPENAI_"))}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "foretell.cli", "edit", *args], capture_output=True,
                          text=True, env=env, timeout=600)


def leftovers(folder) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.endswith(".foretell-tmp")]


# ---- the atomic write ---------------------------------------------------------------------------

def test_write_replaces_the_file_keeping_its_mode(tmp_path):
    path = tmp_path / "a.py"
    path.write_bytes(b"old\n")
    path.chmod(0o640)
    write_atomically(path, "new\n", b"old\n")
    assert path.read_bytes() == b"new\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert leftovers(tmp_path) == []


def test_write_follows_a_symlink_and_keeps_the_link(tmp_path):
    target = tmp_path / "real.py"
    target.write_text("old\n")
    link = tmp_path / "link.py"
    link.symlink_to(target)
    write_atomically(link, "new\n", b"old\n")
    assert link.is_symlink() and target.read_text() == "new\n"


def test_write_refuses_when_the_file_changed_meanwhile(tmp_path):
    path = tmp_path / "a.py"
    path.write_bytes(b"changed by someone else\n")
    with pytest.raises(FileChangedError):
        write_atomically(path, "new\n", b"old\n")
    assert path.read_bytes() == b"changed by someone else\n"
    assert leftovers(tmp_path) == []


def test_a_failure_before_the_replace_leaves_the_original_intact(tmp_path, monkeypatch):
    path = tmp_path / "a.py"
    path.write_bytes(b"old\n")
    with pytest.raises(UnicodeEncodeError):  # a lone surrogate cannot be written as UTF-8
        write_atomically(path, "new \ud800\n", b"old\n")
    assert path.read_bytes() == b"old\n" and leftovers(tmp_path) == []

    def failing_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="No space"):
        write_atomically(path, "new\n", b"old\n")
    assert path.read_bytes() == b"old\n" and leftovers(tmp_path) == []


# ---- the command, offline ----------------------------------------------------------------------

@pytest.mark.parametrize("setup,args,message", [
    (None, ["/no/such/file.py", "-i", "x"], "does not exist"),
    ("binary", ["{file}", "-i", "x"], "not valid UTF-8"),
    ("text", ["{file}", "-i", "x", "--model", "m", "--base-url", "http://127.0.0.1:{port}/v1"],
     "Connection refused"),
    ("text", ["{file}", "-i", "x", "--base-url", "not-a-url"], "base_url must be"),
    ("text", ["{file}", "-i", "   "], "instruction is empty"),
])
def test_bad_input_exits_1_with_a_message_and_no_traceback(tmp_path, setup, args, message):
    file = tmp_path / "f.py"
    if setup == "binary":
        file.write_bytes(b"\xff\xfe\x00x")
    elif setup == "text":
        file.write_text("x = 1\n")
    result = run_edit(*[a.format(file=file, port=free_port()) for a in args])
    assert result.returncode == 1, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    if setup == "text":
        assert file.read_text() == "x = 1\n"


def test_the_statistics_count_changed_lines_that_look_like_diff_headers():
    before, after = "a\n-- note\nb\n", "a\n++ note\nb\n"
    result = EditResult(text=after, original=before, diff=unified_diff(before, after, "f.sql"),
                        output=after, finish_reason="stop", complete=True, seconds=1.0)
    assert "+1 -1 lines" in _edit_stats(result)


def test_write_and_diff_are_exclusive(tmp_path):
    result = run_edit(str(tmp_path / "f.py"), "-i", "x", "--write", "--diff")
    assert result.returncode == 2 and "not allowed with" in result.stderr


# ---- the command against the live server ------------------------------------------------------

@pytest.fixture(scope="module")
def expected(live_server):
    with Client(live_server, max_retries=0, timeout=300) as client:
        return edit(client, FILE, INSTRUCTION, model=MODEL, filename="shapes.py")


@pytest.mark.embedded
def test_edit_prints_the_new_file_and_statistics(tmp_path, live_server, expected):
    path = tmp_path / "shapes.py"
    path.write_text(FILE)
    # No --model: the first model the server lists; the base URL from the environment.
    result = run_edit(str(path), "--instruction", INSTRUCTION, env_extra={"FORETELL_BASE_URL": live_server})
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected.text
    stats = result.stderr.strip().splitlines()[-1]
    assert stats.startswith("foretell edit: ") and "tok/s" in stats and "prediction tokens:" in stats
    assert path.read_text() == FILE  # no --write: untouched


@pytest.mark.embedded
def test_edit_diff_and_write(tmp_path, live_server, expected):
    path = tmp_path / "shapes.py"
    path.write_text(FILE)
    instruction_file = tmp_path / "instruction.txt"
    instruction_file.write_text(INSTRUCTION)
    diff = run_edit(str(path), "--instruction-file", str(instruction_file), "--diff",
                    "--base-url", live_server, "--model", MODEL)
    assert diff.returncode == 0, diff.stderr
    assert diff.stdout == expected.diff
    written = run_edit(str(path), "-i", INSTRUCTION, "--write", "--base-url", live_server, "--model", MODEL)
    assert written.returncode == 0, written.stderr
    assert path.read_text() == expected.text and written.stdout == ""
    assert leftovers(tmp_path) == []


@pytest.mark.embedded
def test_an_edit_cut_off_by_max_tokens_is_refused(tmp_path, live_server):
    path = tmp_path / "shapes.py"
    path.write_text(FILE)
    result = run_edit(str(path), "-i", INSTRUCTION, "--write", "--max-tokens", "5",
                      "--base-url", live_server, "--model", MODEL)
    assert result.returncode == 1
    assert "was not changed" in result.stderr and "Traceback" not in result.stderr
    assert path.read_text() == FILE
