"""The option table (``proxy/options.py``) is the one owner of every ``serve`` / ``generate``
option: the parser, the environment, the server's settings and the configuration file's local
routes all follow it."""

from __future__ import annotations

import pytest

from foretell.cli import build_parser, resolve_env
from foretell.proxy.options import (ENGINE_OPTIONS, PRECISION_KEYS, PRECISION_OPTIONS, REPLICA_OPTIONS, RUN_OPTIONS,
                                    SERVER_OPTIONS)

SERVE_TABLES = (SERVER_OPTIONS, ENGINE_OPTIONS, PRECISION_OPTIONS, RUN_OPTIONS, REPLICA_OPTIONS)


def _serve(argv=()):
    args = build_parser().parse_args(["serve", *argv])
    resolve_env(args)
    return args


def _serve_flags() -> dict:
    [serve] = [action for action in build_parser()._subparsers._group_actions[0].choices.values()
               if action.prog.endswith("serve")]
    return {flag: action for action in serve._actions for flag in action.option_strings}


def test_every_option_is_on_serve_with_its_variable_in_its_help():
    flags = _serve_flags()
    for table in SERVE_TABLES:
        for option in table.values():
            assert option.flag in flags, option.flag
            assert f"(env: {option.env}" in flags[option.flag].help


def test_defaults_come_from_the_table_and_the_server_settings_agree():
    from foretell.proxy.server.settings import ServerSettings

    args = _serve()
    defaults = ServerSettings()
    for option in ENGINE_OPTIONS.values():
        assert getattr(args, option.name) == option.default
        assert getattr(defaults, option.name) == option.default, option.name


@pytest.mark.parametrize("name, raw, expected", [("max_queue", "3", 3), ("draft_cache_scope", "GLOBAL", "global"),
                                                 ("metrics_public", "1", True), ("fp32_head", "0", False),
                                                 ("api_key", "a,b", ["a", "b"]), ("routing", "round-robin",
                                                                                  "round-robin")])
def test_each_kind_reads_its_environment_variable(monkeypatch, name, raw, expected):
    option = {**SERVER_OPTIONS, **ENGINE_OPTIONS, **PRECISION_OPTIONS, **REPLICA_OPTIONS}[name]
    monkeypatch.setenv(option.env, raw)
    assert getattr(_serve(), name) == expected


def test_the_command_line_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv(ENGINE_OPTIONS["max_queue"].env, "3")
    assert _serve(["--max-queue", "5"]).max_queue == 5


def test_a_local_route_takes_the_precision_options_of_the_table(tmp_path):
    from foretell.proxy.server.upstream import load_routes

    assert set(PRECISION_KEYS) == {name for name, option in PRECISION_OPTIONS.items() if option.in_config}
    config = tmp_path / "routes.toml"
    config.write_text('[models.mine]\nlocal = true\ndtype = "bfloat16"\nfp32_head = false\n')
    assert load_routes(str(config)).local_precision() == {"dtype": "bfloat16", "fp32_head": False}
    config.write_text('[models.mine]\nlocal = true\nquantize = "int3"\n')
    with pytest.raises(ValueError, match="quantize must be one of auto, none, int8, int4"):
        load_routes(str(config))
