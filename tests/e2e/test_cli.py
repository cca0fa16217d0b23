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
    (["serve", "--min-replicas", "2"], "--min-replicas needs --replicas N"),
    (["serve", "--replicas", "3", "--max-replicas", "2"], "outside --min-replicas 1 and --max-replicas 2"),
    (["serve", "--replicas", "2", "--routing", "random"], "--routing"),
    (["serve", "--replicas", "2", "--replica-gpus", "-1"], "must be 0 or more"),
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


def test_precision_options_parse(monkeypatch, capsys):
    from foretell.cli import resolve_env, build_parser

    monkeypatch.delenv("FORETELL_DTYPE", raising=False)
    args = build_parser().parse_args(["serve"])
    resolve_env(args)
    # Not set: serve takes the configuration file's local route, else auto / none / by dtype.
    assert (args.dtype, args.quantize, args.fp32_head) == (None, None, None)
    args = build_parser().parse_args(["generate", "--prompt-file", "-", "--dtype", "BFloat16",
                                      "--quantize", "int4", "--no-fp32-head"])
    resolve_env(args)
    assert (args.dtype, args.quantize, args.fp32_head) == ("bfloat16", "int4", False)
    monkeypatch.setenv("FORETELL_FP32_HEAD", "1")
    monkeypatch.setenv("FORETELL_QUANTIZE", "int8")
    args = build_parser().parse_args(["serve"])
    resolve_env(args)
    assert (args.quantize, args.fp32_head) == ("int8", True)
    monkeypatch.setenv("FORETELL_DTYPE", "fp8")
    args = build_parser().parse_args(["serve"])
    with pytest.raises(SystemExit) as exit_:
        resolve_env(args)
    assert exit_.value.code == 2
    assert "FORETELL_DTYPE='fp8': must be auto, float32, bfloat16 or float16" in capsys.readouterr().err


def test_bad_precision_options_are_refused():
    result = run_cli("generate", "--prompt-file", "-", "--quantize", "int2", stdin="x")
    assert result.returncode == 2 and "must be auto, none, int8 or int4, got int2" in result.stderr
    result = run_cli("generate", "--prompt-file", "-", "--fp32-head", "--no-fp32-head", stdin="x")
    assert result.returncode == 2 and "not allowed with argument" in result.stderr


def test_generate_runs_the_default_precision(tmp_path, tiny_model_folder, tiny_model, tokenizer):
    """Without --dtype and --quantize: int8 where this CPU measures it faster than float32 on the
    head (then float32 for the rest), else bf16 with the fp32 head on a CPU with native bf16,
    else float32; the text is that precision's own plain decoding."""
    import copy

    from foretell.proxy.engine.precision import quantize_weights, resolve_dtype, resolve_quantize

    config = tiny_model.config
    quantize = resolve_quantize("auto", "cpu", (config.vocab_size, config.hidden_size))
    model = copy.deepcopy(tiny_model)
    quantize_weights(model, quantize)
    engine = SpeculativeEngine(model, tokenizer, dtype=resolve_dtype("auto", "cpu", quantize))
    prompt = "def area(width, height):\n    return"
    plain = engine.generate(GenerationRequest(prompt_ids=tokenizer(prompt)["input_ids"], max_tokens=24))
    (tmp_path / "prompt.txt").write_text(prompt)
    env = {k: v for k, v in os.environ.items() if k not in ("FORETELL_DTYPE", "FORETELL_QUANTIZE")}
    result = subprocess.run([sys.executable, "-m", "foretell.cli", "generate", "--model", str(tiny_model_folder),
                             "--prompt-file", str(tmp_path / "prompt.txt"), "--max-tokens", "24",
                             "--no-calibrate"], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr
    assert f"precision {engine.precision}" in result.stderr
    if quantize == "int8":
        assert engine.precision == "float32/int8+fp32-head"
    assert result.stdout.rstrip("\n") == plain.text.rstrip("\n")
    assert "Failed to load" not in result.stderr and "Enum subclass" not in result.stderr  # torchao's noise


def test_generate_quantized(tmp_path, tiny_model_folder):
    (tmp_path / "prompt.txt").write_text("def area(width, height):\n    return")
    result = run_cli("generate", "--model", str(tiny_model_folder), "--prompt-file", str(tmp_path / "prompt.txt"),
                     "--max-tokens", "8", "--no-calibrate", "--dtype", "bfloat16", "--quantize", "int8",
                     "--json-stats")
    assert result.returncode == 0, result.stderr
    assert "precision bfloat16/int8" in result.stderr
    assert json.loads(result.stderr.strip().splitlines()[-1])["completion_tokens"] == 8


def test_serve_takes_the_precision_from_the_command_line_else_the_local_route(tmp_path, monkeypatch):
    import uvicorn

    import foretell.proxy.server as server_package
    import foretell.proxy.server.logs as logs
    from foretell.cli import main

    started = []
    monkeypatch.setattr(server_package, "create_app", lambda settings: started.append(settings))
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: None)
    monkeypatch.setattr(logs, "configure_logging", lambda *args: None)
    monkeypatch.delenv("FORETELL_DTYPE", raising=False)
    config = tmp_path / "routes.toml"
    config.write_text('[models."gemma-3-270m"]\nlocal = true\ndtype = "float16"\nquantize = "int8"\n')

    main(["serve", "--config", str(config)])
    main(["serve", "--config", str(config), "--dtype", "bfloat16", "--no-fp32-head"])
    main(["serve"])
    assert [(s.dtype, s.quantize, s.fp32_head) for s in started] == [
        ("float16", "int8", None), ("bfloat16", "int8", False), ("auto", "auto", None)]


def test_kernels_option(monkeypatch, capsys):
    from foretell.cli import resolve_env, build_parser

    monkeypatch.delenv("FORETELL_KERNELS", raising=False)
    args = build_parser().parse_args(["serve"])
    resolve_env(args)
    assert args.kernels is None  # the engine's default: FORETELL_KERNELS, else auto
    args = build_parser().parse_args(["generate", "--prompt-file", "-", "--kernels", "Reference"])
    resolve_env(args)
    assert args.kernels == "reference"
    monkeypatch.setenv("FORETELL_KERNELS", "triton")
    args = build_parser().parse_args(["serve"])
    resolve_env(args)
    assert args.kernels == "triton"
    monkeypatch.setenv("FORETELL_KERNELS", "cuda")
    args = build_parser().parse_args(["serve"])
    with pytest.raises(SystemExit) as exit_:
        resolve_env(args)
    assert exit_.value.code == 2
    assert "FORETELL_KERNELS='cuda': must be auto, triton or reference" in capsys.readouterr().err
