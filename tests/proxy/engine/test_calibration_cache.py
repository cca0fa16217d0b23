"""The calibration cache (issue 11, item 7): the first start measures the pass cost and keeps it
under the foretell cache folder; later starts on the same machine, model and torch use the file
instead of measuring; ``--recalibrate`` measures again; ``--no-calibrate`` does neither.

The file's figures are replaced by made-up ones between runs, so a run that reports or uses those
figures has read the file, and one that reports others has measured."""

from __future__ import annotations

import json
import logging

import pytest

from foretell.cli import main
from foretell.proxy.engine import SpeculativeEngine
from foretell.proxy.engine import calibration_cache
from foretell.proxy.engine.calibration_cache import calibrate_with_cache, calibration_dir, key_parts
from foretell.proxy.engine.draft_length import PassCostModel

MADE_UP_PASS = {"fixed": 0.123, "per_position": 0.0045}
MADE_UP_SAMPLING = {"fixed": 0.0625, "per_position": 0.03125}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FORETELL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def calibration_files() -> list:
    folder = calibration_dir()
    return sorted(folder.glob("*.json")) if folder.is_dir() else []


def make_up(path) -> dict:
    """Replace the stored figures by made-up ones (the key stays)."""
    stored = json.loads(path.read_text())
    stored["pass_cost"], stored["sampling_cost"] = MADE_UP_PASS, MADE_UP_SAMPLING
    path.write_text(json.dumps(stored))
    return stored


def counting_calibrate(engine, fake: PassCostModel | None = None) -> list:
    """Count the engine's measurements; with ``fake``, measure nothing and report that figure
    (a real measurement of the tiny model takes seconds on a small CPU)."""
    calls = []
    measure = engine.calibrate

    def calibrate(*args, **kwargs):
        calls.append(1)
        if fake is None:
            return measure(*args, **kwargs)
        engine.cost.reset(fake)
        engine.sampling_cost = fake
        return fake

    engine.calibrate = calibrate
    return calls


FAKE = PassCostModel(fixed=0.25, per_position=0.015625)


def test_measured_once_then_read_from_the_file(cache_dir, tiny_model, tokenizer, tiny_model_folder):
    first = SpeculativeEngine(tiny_model, tokenizer)
    outcome = calibrate_with_cache(first, tiny_model_folder)
    assert not outcome.from_cache
    (path,) = calibration_files()
    assert path == outcome.path and path.parent == cache_dir / "calibration"
    stored = json.loads(path.read_text())
    assert stored["key"] == key_parts(first, tiny_model_folder)
    assert PassCostModel(**stored["pass_cost"]) == first.cost.prior == outcome.pass_cost
    assert PassCostModel(**stored["sampling_cost"]) == first.sampling_cost

    # A later start: the engine's prior is the file's, and nothing is measured.
    make_up(path)
    later = SpeculativeEngine(tiny_model, tokenizer)
    calls = counting_calibrate(later)
    outcome = calibrate_with_cache(later, tiny_model_folder)
    assert outcome.from_cache and calls == []
    assert later.cost.prior == later.pass_cost == PassCostModel(**MADE_UP_PASS)
    assert later.sampling_cost == PassCostModel(**MADE_UP_SAMPLING)

    # recalibrate: measured again and the file rewritten with the new figures.
    again = SpeculativeEngine(tiny_model, tokenizer)
    calls = counting_calibrate(again, FAKE)
    outcome = calibrate_with_cache(again, tiny_model_folder, recalibrate=True)
    assert not outcome.from_cache and calls == [1]
    rewritten = json.loads(path.read_text())
    assert PassCostModel(**rewritten["pass_cost"]) == again.cost.prior == FAKE
    assert calibration_files() == [path]  # no temporary file left behind


@pytest.mark.parametrize("content", ["{not json", '{"key": 1}', "null"])
def test_an_unusable_file_is_measured_over(cache_dir, tiny_model, tokenizer, tiny_model_folder, content):
    engine = SpeculativeEngine(tiny_model, tokenizer)
    path = calibration_cache.cache_path(key_parts(engine, tiny_model_folder))
    path.parent.mkdir(parents=True)
    path.write_text(content)
    calls = counting_calibrate(engine, FAKE)
    assert not calibrate_with_cache(engine, tiny_model_folder).from_cache and calls == [1]
    assert PassCostModel(**json.loads(path.read_text())["pass_cost"]) == FAKE


def test_figures_that_are_not_costs_are_measured_over(cache_dir, tiny_model, tokenizer, tiny_model_folder):
    engine = SpeculativeEngine(tiny_model, tokenizer)
    calls = counting_calibrate(engine, FAKE)
    calibrate_with_cache(engine, tiny_model_folder)
    (path,) = calibration_files()
    stored = json.loads(path.read_text())
    stored["pass_cost"] = {"fixed": -1.0, "per_position": 0.01}
    path.write_text(json.dumps(stored))
    assert not calibrate_with_cache(engine, tiny_model_folder).from_cache and calls == [1, 1]
    assert calibrate_with_cache(engine, tiny_model_folder).from_cache and calls == [1, 1]


def test_the_key_follows_machine_torch_and_model(tiny_model, tokenizer, tiny_model_folder, tmp_path, monkeypatch):
    import torch

    engine = SpeculativeEngine(tiny_model, tokenizer)
    parts = key_parts(engine, tiny_model_folder)
    assert parts["torch"] == torch.__version__ and parts["device"] == "cpu" and parts["cpu"]
    base = calibration_cache.cache_path(parts)
    assert calibration_cache.cache_path(dict(parts)) == base  # stable

    monkeypatch.setattr(torch, "__version__", "0.0.0+other")
    assert calibration_cache.cache_path(key_parts(engine, tiny_model_folder)) != base
    monkeypatch.undo()
    monkeypatch.setattr(calibration_cache.platform, "node", lambda: "another-machine")
    assert calibration_cache.cache_path(key_parts(engine, tiny_model_folder)) != base
    monkeypatch.undo()

    # A folder without a manifest: its path and files; one with: the manifest.
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    plain = calibration_cache.model_identity(folder)
    (folder / "config.json").write_text('{"changed": 1}')
    assert calibration_cache.model_identity(folder) != plain
    (folder / "foretell-cache.json").write_text('{"files": {}}')
    sealed = calibration_cache.model_identity(folder)
    assert sealed.startswith("manifest:")
    (folder / "foretell-cache.json").write_text('{"files": {"other": 1}}')
    assert calibration_cache.model_identity(folder) != sealed


# ---- the commands -------------------------------------------------------------------------------------

def generate(capsys, folder, prompt_file, *options) -> str:
    assert main(["generate", "--model", str(folder), "--prompt-file", str(prompt_file), "--max-tokens", "2",
                 *options]) == 0
    return capsys.readouterr().err


def test_foretell_generate_caches_its_calibration(cache_dir, tiny_model_folder, tmp_path, capsys, monkeypatch):
    measured = []

    def calibrate(engine):  # as the engine's, without the seconds of timing passes
        measured.append(1)
        engine.cost.reset(FAKE)
        engine.sampling_cost = FAKE
        return FAKE

    monkeypatch.setattr(SpeculativeEngine, "calibrate", calibrate)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("def f(x):")
    err = generate(capsys, tiny_model_folder, prompt)
    assert "foretell: loading the model" in err
    assert "foretell: calibrating pass cost (cached for next time) ..." in err and measured == [1]
    assert "pass cost 250 ms + 15.6 ms per position" in err
    (path,) = calibration_files()
    make_up(path)

    err = generate(capsys, tiny_model_folder, prompt)
    assert "foretell: calibration from cache" in err and "calibrating" not in err
    assert "pass cost 123 ms + 4.5 ms per position" in err  # the file's figures
    assert measured == [1]

    err = generate(capsys, tiny_model_folder, prompt, "--no-calibrate")
    assert "calibrat" not in err and "pass cost" not in err
    assert json.loads(path.read_text())["pass_cost"] == MADE_UP_PASS

    err = generate(capsys, tiny_model_folder, prompt, "--recalibrate")
    assert "calibrating pass cost" in err and "from cache" not in err
    assert "pass cost 250 ms + 15.6 ms per position" in err and measured == [1, 1]
    assert PassCostModel(**json.loads(path.read_text())["pass_cost"]) == FAKE


def test_foretell_serve_reads_and_recalibrates(cache_dir, tiny_model_folder, tiny_model, tokenizer, caplog):
    import time

    from starlette.testclient import TestClient

    from foretell.proxy.server import ServerSettings, create_app

    engine = SpeculativeEngine(tiny_model, tokenizer)
    counting_calibrate(engine, FAKE)
    calibrate_with_cache(engine, tiny_model_folder)  # the file a first start would have written
    (path,) = calibration_files()
    make_up(path)

    def serve(**settings) -> None:
        app = create_app(ServerSettings(model=str(tiny_model_folder), dtype="float32", **settings))
        with TestClient(app, base_url="http://127.0.0.1") as client:
            deadline = time.time() + 120
            while client.get("/health").status_code != 200:
                assert time.time() < deadline, client.get("/health").text
                time.sleep(0.1)

    serve()
    assert json.loads(path.read_text())["pass_cost"] == MADE_UP_PASS  # read, not measured over
    serve(calibrate=False, recalibrate=True)  # --no-calibrate wins: nothing measured
    assert json.loads(path.read_text())["pass_cost"] == MADE_UP_PASS
    serve(recalibrate=True)
    assert json.loads(path.read_text())["pass_cost"] != MADE_UP_PASS


def test_the_serve_options_parse(monkeypatch, capsys):
    from foretell.cli import resolve_env, build_parser

    args = build_parser().parse_args(["serve", "--recalibrate", "--log-level", "DEBUG", "--log-format", "json"])
    resolve_env(args)
    assert (args.recalibrate, args.log_level, args.log_format) == (True, "debug", "json")
    monkeypatch.setenv("FORETELL_LOG_FORMAT", "JSON")
    monkeypatch.setenv("FORETELL_RECALIBRATE", "1")
    args = build_parser().parse_args(["serve"])
    resolve_env(args)
    assert (args.recalibrate, args.log_level, args.log_format) == (True, "info", "json")
    monkeypatch.setenv("FORETELL_LOG_LEVEL", "loud")
    args = build_parser().parse_args(["serve"])
    with pytest.raises(SystemExit) as exit_:
        resolve_env(args)
    assert exit_.value.code == 2
    assert "FORETELL_LOG_LEVEL='loud': must be debug, info, warning or error" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--log-format", "xml"])
    assert logging.getLogger("foretell.access")  # the logger name the README documents
