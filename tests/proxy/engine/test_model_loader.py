"""The converted-model cache: a half-written or corrupted folder is detected and rebuilt."""

from __future__ import annotations

import json

import pytest

from foretell.proxy.engine import model_loader
from foretell.proxy.engine.model_loader import MANIFEST_NAME, cache_is_valid, write_manifest


def make_folder(path):
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "x"}')
    (path / "model.safetensors").write_bytes(b"\x00" * 1000)
    return path


def test_sealed_folder_is_valid(tmp_path):
    folder = make_folder(tmp_path / "m")
    write_manifest(folder)
    assert cache_is_valid(folder) == (True, "")


@pytest.mark.parametrize("damage,reason", [
    (lambda f: (f / MANIFEST_NAME).unlink(), "no manifest"),
    (lambda f: (f / "model.safetensors").write_bytes(b"\x00" * 500), "wrong size"),
    (lambda f: (f / "model.safetensors").write_bytes(b"\x01" + b"\x00" * 999), "checksum"),
    (lambda f: (f / "config.json").unlink(), "missing"),
    (lambda f: (f / MANIFEST_NAME).write_text("{not json"), "unreadable"),
])
def test_damaged_folder_is_rejected(tmp_path, damage, reason):
    folder = make_folder(tmp_path / "m")
    write_manifest(folder)
    damage(folder)
    ok, why = cache_is_valid(folder)
    assert not ok and reason in why


def test_damaged_cache_is_rebuilt_not_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("FORETELL_CACHE_DIR", str(tmp_path))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF fake")
    conversions = []

    def convert(gguf_path, destination, dtype):  # the slow transformers conversion, stood in for
        conversions.append(destination)
        make_folder(destination)
        write_manifest(destination)

    monkeypatch.setattr(model_loader, "_convert_gguf", convert)
    first = model_loader.converted_folder_for_gguf(gguf)
    assert len(conversions) == 1
    assert model_loader.converted_folder_for_gguf(gguf) == first and len(conversions) == 1
    (first / "model.safetensors").write_bytes(b"\x07" * 1000)  # same size, other bytes
    assert model_loader.converted_folder_for_gguf(gguf) == first
    assert len(conversions) == 2
    assert json.loads((first / MANIFEST_NAME).read_text())["files"]["model.safetensors"]["size"] == 1000


def test_unknown_model_spec_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="neither"):
        model_loader.resolve_model_folder(str(tmp_path / "nothing-here"))
