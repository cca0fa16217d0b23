"""The ``foretell`` command, run as a user runs it (a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from foretell.proxy.engine import GenerationRequest, SpeculativeEngine


def run_cli(*args, stdin=None):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "foretell.cli", *args], capture_output=True,
                          text=True, input=stdin, env=env, timeout=600)


def test_help_lists_every_option():
    result = run_cli("generate", "--help")
    assert result.returncode == 0
    for option in ("--prompt-file", "--prediction-file", "--prompt-lookup", "--max-tokens",
                   "--model", "--stop", "--max-draft", "--temperature", "--top-p", "--top-k", "--seed"):
        assert option in result.stdout


@pytest.mark.parametrize("args,message", [
    (["generate", "--prompt-file", "/no/such/file"], "does not exist"),
    (["generate", "--prompt-file", "-", "--max-tokens", "0"], "positive integer"),
    (["generate"], "--prompt-file"),
    (["generate", "--prompt-file", "-", "--temperature", "3"], "must lie in [0, 2]"),
    (["generate", "--prompt-file", "-", "--top-p", "0"], "must lie in (0, 1]"),
    (["generate", "--prompt-file", "-", "--model", "/no/such/model"], "cannot load model"),
])
def test_bad_input_gives_a_clear_error(args, message):
    result = run_cli(*args, stdin="hello")
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_generate_prints_the_engines_completion_and_statistics(tmp_path, tiny_model_folder,
                                                                 tiny_model, tokenizer):
    prompt = "def area(width, height):\n    return"
    engine = SpeculativeEngine(tiny_model, tokenizer)
    plain = engine.generate(GenerationRequest(prompt_ids=tokenizer(prompt)["input_ids"], max_tokens=30))
    (tmp_path / "prompt.txt").write_text(prompt)
    (tmp_path / "prediction.txt").write_text(plain.text)

    result = run_cli("generate", "--model", str(tiny_model_folder), "--prompt-file",
                     str(tmp_path / "prompt.txt"), "--prediction-file", str(tmp_path / "prediction.txt"),
                     "--max-tokens", "30", "--no-calibrate", "--json-stats")
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip("\n") == plain.text.rstrip("\n")
    stats = json.loads(result.stderr.strip().splitlines()[-1])
    assert stats["completion_tokens"] == 30
    assert stats["per_source"]["prediction"]["accepted"] > 0
    assert stats["target_passes"] < 30


def test_generate_samples_and_a_seed_replays(tmp_path, tiny_model_folder):
    (tmp_path / "prompt.txt").write_text("def area(width, height):\n    return")
    args = ["generate", "--model", str(tiny_model_folder), "--prompt-file", str(tmp_path / "prompt.txt"),
            "--max-tokens", "12", "--no-calibrate", "--json-stats", "--temperature", "0.9",
            "--top-k", "50", "--prediction-file", str(tmp_path / "prompt.txt")]
    first, again = run_cli(*args, "--seed", "4"), run_cli(*args, "--seed", "4")
    assert first.returncode == 0, first.stderr
    assert first.stdout == again.stdout and first.stdout.strip()
    assert json.loads(first.stderr.strip().splitlines()[-1])["seed"] == 4
    unseeded = run_cli(*args)
    assert isinstance(json.loads(unseeded.stderr.strip().splitlines()[-1])["seed"], int)
