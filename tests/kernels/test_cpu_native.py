"""Building the native CPU loops: a source that does not compile leaves its caller on the torch
operations (None, and one warning naming it), and a built one is imported from the cache folder
without building again."""

import logging

import pytest

from foretell.kernels import cpu_native


def test_a_source_that_does_not_build_gives_none_and_says_so(tmp_path, monkeypatch, caplog):
    (tmp_path / "broken.cpp").write_text("this is not C++;\n")
    monkeypatch.setattr(cpu_native, "HERE", tmp_path)
    monkeypatch.setitem(cpu_native.EXTENSIONS, "broken", "a broken loop")
    monkeypatch.setenv("FORETELL_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="foretell.kernels"):
        assert cpu_native.load_native("broken") is None
    assert any("a broken loop unavailable" in record.getMessage() for record in caplog.records)


def test_a_built_loop_is_found_in_the_cache_folder():
    module = cpu_native.load_native("int8_rows")
    if module is None:
        pytest.skip("no C++ compiler here: the first test covers this machine's path")
    folder = cpu_native.build_dir("int8_rows")
    assert list(folder.glob("foretell_int8_rows*.so")), f"nothing built in {folder}"
    assert cpu_native._import_built("foretell_int8_rows", folder).scale_rows is not None
