"""``foretell edit``: the atomic write, and the command as a subprocess, offline (its edits against
a live ``foretell serve`` are tests/e2e/test_cli_edit.py)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from foretell.cli import FileChangedError, edit_stats, write_atomically
from foretell.sdk import EditResult, unified_diff
from tests.sdk.conftest import free_port


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
    assert "+1 -1 lines" in edit_stats(result)


def test_write_and_diff_are_exclusive(tmp_path):
    result = run_edit(str(tmp_path / "f.py"), "-i", "x", "--write", "--diff")
    assert result.returncode == 2 and "not allowed with" in result.stderr
