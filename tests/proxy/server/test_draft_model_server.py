"""``--draft-model`` through the server and the command line: /health names the draft, a request
drafts from it (the official ``openai`` client, foretell's ``speculation`` extension) and gets the
text of plain decoding, streamed or not; a request asking for a draft model the route does not
have is refused with a 400 naming the field; the option reaches the engine from the command line
and from a local route of the configuration file."""

from __future__ import annotations

import json

import httpx
import pytest

from foretell.proxy.engine import GenerationRequest, SpeculativeEngine
from foretell.proxy.engine.draft_length import PassCostModel
from tests.e2e.test_cli import run_cli
from tests.helpers import assert_envelope
from tests.serving import serve, tiny_app

PROMPT = "The quick brown fox jumps over the lazy dog. Naïve café – 東京 😀 "


@pytest.fixture(scope="module")
def drafted(tiny_model_folder):
    """The tiny model drafting for itself from its own folder (a draft with the same tokenizer),
    its passes made to look cheap so that it drafts."""
    with serve(tiny_app(tiny_model_folder, draft_model=str(tiny_model_folder)), "draft-model") as served:
        engine = served.app.state.foretell.local.scheduler.engine
        engine.draft_model.cost.reset(PassCostModel(1e-6, 1e-6))
        engine.draft_model.cost.observe = lambda *args: None
        yield served


def test_health_names_the_draft_model(drafted, tiny_model_folder, tiny_server):
    assert httpx.get(drafted.base + "/health").json()["draft_model"] == str(tiny_model_folder)
    assert httpx.get(tiny_server.base + "/health").json()["draft_model"] is None


def test_a_request_drafts_from_the_model_and_gets_plain_text(drafted, tiny_model, tokenizer):
    from openai import OpenAI

    plain = SpeculativeEngine(tiny_model, tokenizer).generate(
        GenerationRequest(prompt_ids=tokenizer(PROMPT)["input_ids"], max_tokens=24)).text
    client = OpenAI(base_url=drafted.base + "/v1", api_key="none", max_retries=0)
    answer = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                                       extra_body={"speculation": {"report_origins": True}})
    assert answer.choices[0].text == plain
    assert answer.model_extra["speculation"]["per_source"]["draft_model"]["accepted"] > 0
    chunks = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == plain
    off = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                                    extra_body={"speculation": {"draft_model": False}})
    assert off.choices[0].text == plain and "draft_model" not in off.model_extra["speculation"]["per_source"]


def test_asking_for_a_draft_model_where_there_is_none_is_a_400(tiny_server):
    for model in ("tiny", "up-ok"):  # local without a draft, and an upstream route
        response = httpx.post(tiny_server.base + "/v1/completions", timeout=60, json={
            "model": model, "prompt": "x", "max_tokens": 2, "speculation": {"draft_model": True}})
        assert "draft" in assert_envelope(response, 400, param="speculation.draft_model")["message"]


def test_generate_with_a_draft_model(tmp_path, tiny_model_folder, tiny_model, tokenizer):
    prompt = "def area(width, height):\n    return"
    plain = SpeculativeEngine(tiny_model, tokenizer).generate(
        GenerationRequest(prompt_ids=tokenizer(prompt)["input_ids"], max_tokens=16)).text
    (tmp_path / "prompt.txt").write_text(prompt)
    result = run_cli("generate", "--model", str(tiny_model_folder), "--prompt-file", str(tmp_path / "prompt.txt"),
                     "--max-tokens", "16", "--json-stats", "--draft-model", "self:int8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip("\n") == plain.rstrip("\n")
    assert "draft pass cost" in result.stderr
    assert "draft_model" in json.loads(result.stderr.strip().splitlines()[-1])["per_source"]
    bad = run_cli("generate", "--model", str(tiny_model_folder), "--prompt-file", str(tmp_path / "prompt.txt"),
                  "--draft-model", "self:int3")
    assert bad.returncode != 0 and "self:int8" in bad.stderr and "Traceback" not in bad.stderr


def test_serve_takes_the_draft_model_from_the_command_line_else_the_local_route(tmp_path, monkeypatch):
    import uvicorn

    import foretell.proxy.server as server_package
    import foretell.proxy.server.logs as logs
    from foretell.cli import main

    started = []
    monkeypatch.setattr(server_package, "create_app", lambda settings: started.append(settings))
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: None)
    monkeypatch.setattr(logs, "configure_logging", lambda *args: None)
    monkeypatch.delenv("FORETELL_DRAFT_MODEL", raising=False)
    config = tmp_path / "routes.toml"
    config.write_text('[models."gemma-3-270m"]\nlocal = true\ndraft_model = "self:int8"\n')
    main(["serve", "--config", str(config)])
    main(["serve", "--config", str(config), "--draft-model", "/models/small"])
    main(["serve"])
    assert [s.draft_model for s in started] == ["self:int8", "/models/small", None]
    config.write_text('[models."gemma-3-270m"]\nlocal = true\ndraft_model = 3\n')
    with pytest.raises(SystemExit, match="draft_model must be a non-empty string"):
        main(["serve", "--config", str(config)])
