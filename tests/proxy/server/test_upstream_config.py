"""Route configuration: the TOML file, the default-upstream environment, and bad files."""

from __future__ import annotations

from pathlib import Path

import pytest

from foretell.proxy.server.upstream import Upstream, load_routes, prepare_body

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "foretell.toml"


def test_example_config_loads():
    table = load_routes(str(EXAMPLE), environ={})
    assert table.route_for("gpt-4.1-mini", set()).upstream == "openai"
    assert table.route_for("gemma-3-270m", set()).fallback == "local-vllm"
    assert table.route_for("unknown-model", set()) is None


def test_default_upstream_from_the_environment():
    table = load_routes(None, environ={"FORETELL_UPSTREAM_BASE_URL": "http://127.0.0.1:9/v1",
                                       "FORETELL_UPSTREAM_API_KEY": "sk-env"})
    route = table.route_for("any-model", {"gemma-3-270m"})
    assert route.upstream == "default" and table.upstreams["default"].key() == "sk-env"
    assert table.route_for("gemma-3-270m", {"gemma-3-270m"}).local  # local names stay local
    assert "sk-env" not in repr(table.upstreams["default"])  # keys never shown


@pytest.mark.parametrize("text,message", [
    ('[models.x]\nupstream = "nowhere"\n', "unknown upstream"),
    ('[upstreams.a]\napi_key_env = "K"\n', "needs base_url"),
    ('[models.x]\nfallback = "a"\n', "unknown upstream"),
    ("this is = not toml [", "not valid TOML"),
    ('[models.x]\nlocal = true\ndtyp = "bfloat16"\n', r"unknown keys \['dtyp'\]"),
    ('[models.x]\nlocal = true\ndtype = "fp8"\n', "dtype must be one of auto, float32, bfloat16, float16"),
    ('[models.x]\nlocal = true\nquantize = "int2"\n', "quantize must be one of auto, none, int8, int4"),
    ('[models.x]\nlocal = true\nfp32_head = "yes"\n', "fp32_head must be one of true, false"),
    ('[upstreams.a]\nbase_url = "http://127.0.0.1:9/v1"\n[models.x]\nupstream = "a"\nquantize = "int4"\n',
     "apply to a local model"),
])
def test_bad_config_is_a_clear_error(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_routes(str(path), environ={})


def test_prepare_body_drops_local_fields_and_unsupported_prediction():
    body = {"model": "m", "prediction": {"type": "content", "content": "x"}, "speculation": {}}
    sent, notes = prepare_body(body, Upstream(name="u", base_url="http://x"))
    assert "prediction" not in sent and "speculation" not in sent and notes
    sent, notes = prepare_body(body, Upstream(name="u", base_url="http://x", supports_prediction=True))
    assert sent["prediction"] == body["prediction"] and not notes


def test_a_local_route_sets_the_precision(tmp_path):
    path = tmp_path / "routes.toml"
    path.write_text('[models.a]\nlocal = true\ndtype = "bfloat16"\nquantize = "int4"\n'
                    '[models.b]\nlocal = true\nfp32_head = false\n')
    assert load_routes(str(path), environ={}).local_precision() == {
        "dtype": "bfloat16", "quantize": "int4", "fp32_head": False}
    path.write_text('[models.a]\nlocal = true\ndtype = "bfloat16"\n[models.b]\nlocal = true\ndtype = "float32"\n')
    with pytest.raises(ValueError, match="one local model, one precision"):
        load_routes(str(path), environ={}).local_precision()
