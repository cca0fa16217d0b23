"""The ``foretell`` command before any model work: --version, python -m foretell, environment
values, and the hint a bare (SDK-only) install gives for the commands that need the proxy extra.
Run as a user runs it (subprocesses); none of this loads a model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from foretell import __version__


def run(*args, env=None, code=None):
    environment = dict(os.environ, HF_HUB_OFFLINE="1", **(env or {}))
    command = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "foretell", *args]
    return subprocess.run(command, capture_output=True, text=True, env=environment, timeout=300)


def test_version_prints_the_version_and_exits_0():
    result = run("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"foretell {__version__}"


def test_python_dash_m_foretell_is_the_command():
    result = run("edit", "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: foretell edit")


def test_help_names_every_path_served_and_every_origin_colour():
    from foretell.origin_colors import STYLES

    serve = " ".join(run("serve", "--help").stdout.split())  # argparse wraps the lines
    for route in ("POST /tokenize", "POST /detokenize", "playground page at GET /"):
        assert route in serve, route
    edit = " ".join(run("edit", "--help").stdout.split())
    colours = {"prediction": ("\x1b[32m", "green from the prediction"),
               "prompt_lookup": ("\x1b[36m", "cyan from prompt lookup"),
               "suffix_cache": ("\x1b[35m", "magenta from the draft cache"),
               "draft_model": ("\x1b[33m", "yellow from a server's draft model")}
    assert set(colours) == set(STYLES)  # a new origin needs its colour in the help too
    for origin, (style, words) in colours.items():
        assert STYLES[origin] == style and words in edit, origin


@pytest.mark.parametrize("variable,value,reason", [
    ("FORETELL_PORT", "abc", "must be an integer"),
    ("FORETELL_MAX_QUEUE", "0", "must be a positive integer, got 0"),
    ("FORETELL_MAX_BODY_BYTES", "4MiB", "must be a positive integer"),
    ("FORETELL_DEFAULT_MAX_TOKENS", "-5", "must be a positive integer, got -5"),
])
def test_a_bad_environment_value_is_one_line_naming_the_variable_and_exit_2(variable, value, reason):
    # --port on the command line would win over the variable; without it the variable is read.
    result = run("serve", env={variable: value})
    assert result.returncode == 2
    assert result.stderr == f"foretell: environment variable {variable}={value!r}: {reason}\n"


def test_a_bad_serve_variable_breaks_neither_help_nor_other_commands(tmp_path):
    bad = {"FORETELL_PORT": "abc", "FORETELL_MAX_QUEUE": "many"}
    assert run("serve", "--help", env=bad).returncode == 0
    assert run("--help", env=bad).returncode == 0
    result = run("edit", str(tmp_path / "missing.py"), "-i", "x", env=bad)
    assert result.returncode == 1 and "does not exist" in result.stderr  # edit ran
    assert "Traceback" not in result.stderr


def test_a_command_line_option_wins_over_a_bad_variable():
    # The variable is never read when the option is given (the run stops at the missing extra).
    result = run("serve", "--port", "9", code=BLOCKED.format(modules=("uvicorn",)),
                 env={"FORETELL_PORT": "abc"})
    assert "FORETELL_PORT" not in result.stderr and "needs the proxy extra" in result.stderr


# A bare install: the proxy extra's modules cannot be imported.
BLOCKED = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {modules!r}:
            raise ModuleNotFoundError('No module named ' + repr(name), name=name)
sys.meta_path.insert(0, Block())
from foretell.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("modules", [("uvicorn",), ("torch", "transformers"), ("fastapi",)])
def test_serve_without_the_proxy_extra_says_how_to_install_it(modules):
    result = run("serve", code=BLOCKED.format(modules=modules))
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    assert line.startswith("foretell: `foretell serve` needs the proxy extra (missing module ")
    assert line.endswith("pip install 'foretell[proxy]' (from a checkout: pip install -e '.[proxy]')")
    assert "Traceback" not in result.stderr


def test_generate_without_the_proxy_extra_says_so_after_its_progress_line(tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hello")
    result = run("generate", "--prompt-file", str(prompt), code=BLOCKED.format(modules=("torch",)))
    assert result.returncode == 1
    # The progress line comes before the imports: it is printed even when they fail.
    assert result.stderr.splitlines() == [
        "foretell: loading the model...",
        "foretell: `foretell generate` needs the proxy extra (missing module 'torch'): "
        "pip install 'foretell[proxy]' (from a checkout: pip install -e '.[proxy]')",
    ]


def test_edit_works_without_the_proxy_extra(tmp_path):
    result = run("edit", str(tmp_path / "missing.py"), "-i", "x",
                 code=BLOCKED.format(modules=("torch", "transformers", "uvicorn", "fastapi")))
    assert result.returncode == 1 and "does not exist" in result.stderr


def test_edit_timeout_must_be_positive(tmp_path):
    result = run("edit", str(tmp_path / "f.py"), "-i", "x", "--timeout", "0")
    assert result.returncode == 2 and "must be a positive number of seconds" in result.stderr
