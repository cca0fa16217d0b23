"""The draft cache of earlier answers through the server: which tenant scope a request lands in
(API key, ``user``, one shared scope), the per-request opt-out, the origin in the report and in
/metrics, and stream == final text with the cache warm. Asserted on the cache's own contents,
never on timing."""

from __future__ import annotations

import httpx
import pytest

from foretell.proxy.server.draft_scope import draft_cache_scope, key_identity
from tests.serving import serve, tiny_app

KEYS = ("key-alice", "key-bob")
PROMPT = "The quick brown fox jumps over the lazy dog. Naïve café – 東京 😀 "


def test_scope_rules():
    alice = key_identity("Bearer key-alice")
    assert alice and alice == key_identity("Bearer  key-alice") and "key-alice" not in alice
    assert key_identity(None) is None and key_identity("Bearer ") is None
    assert draft_cache_scope("key", alice, "u1") == f"key:{alice}"
    assert draft_cache_scope("key", None, "u1") == "user:u1"  # no keys configured: the user field
    assert draft_cache_scope("key", None, None) == "shared"
    assert draft_cache_scope("user", alice, "u1") == f"key:{alice}/user:u1"
    assert draft_cache_scope("user", alice, None) == f"key:{alice}"
    assert draft_cache_scope("user", None, "u1") == "user:u1"
    assert draft_cache_scope("global", alice, "u1") == "global"
    assert draft_cache_scope("off", alice, "u1") is None
    assert draft_cache_scope("key", alice, "u1", wanted=False) is None


@pytest.fixture(scope="module")
def keyed(tiny_model_folder):
    with serve(tiny_app(tiny_model_folder, api_keys=KEYS, draft_cache_scope="key"), "draft-cache") as served:
        yield served


def cache_of(served):
    return served.app.state.foretell.local.scheduler.engine.draft_cache


def complete(served, key, *, stream=False, **extra):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "stream": stream, **extra}
    response = httpx.post(served.base + "/v1/completions", json=body, timeout=120,
                          headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    if not stream:
        return response.json()
    text, report = "", None
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            import json

            chunk = json.loads(line[6:])
            text += "".join(choice["text"] for choice in chunk["choices"])
            report = chunk.get("speculation", report)
    return {"choices": [{"text": text}], "speculation": report}


def test_each_key_drafts_from_its_own_answers_only(keyed):
    cache = cache_of(keyed)
    alice, bob = (f"key:{key_identity('Bearer ' + key)}" for key in KEYS)
    first = complete(keyed, "key-alice")
    assert "suffix_cache" in first["speculation"]["per_source"]
    assert cache.cached_requests(alice) == 1 and cache.cached_requests(bob) == 0
    second = complete(keyed, "key-alice")
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert cache.cached_requests(alice) == 2 and cache.cached_requests(bob) == 0
    complete(keyed, "key-bob", user="someone")  # with keys, the key decides, not the user field
    assert cache.cached_requests(bob) == 1 and cache.cached_requests(alice) == 2


def test_a_request_can_opt_out(keyed):
    cache = cache_of(keyed)
    before = cache.snapshot()
    answer = complete(keyed, "key-alice", speculation={"draft_cache": False})
    assert "suffix_cache" not in answer["speculation"]["per_source"]
    assert cache.snapshot() == before


def test_a_draft_cache_field_that_is_not_a_boolean_is_refused(keyed):
    response = httpx.post(keyed.base + "/v1/completions", timeout=60, headers={"authorization": "Bearer key-alice"},
                          json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4,
                                "speculation": {"draft_cache": "yes"}})
    assert response.status_code == 400, response.text
    assert "draft_cache" in response.text


def test_a_seeded_sampled_request_stays_out_so_its_seed_replays(keyed):
    cache = cache_of(keyed)
    before = cache.snapshot()
    answer = complete(keyed, "key-alice", temperature=0.8, seed=7)
    assert "suffix_cache" not in answer["speculation"]["per_source"]
    assert cache.snapshot() == before
    unseeded = complete(keyed, "key-alice", temperature=0.8)
    assert "suffix_cache" in unseeded["speculation"]["per_source"]


def test_stream_equals_final_text_with_the_cache_warm(keyed):
    whole = complete(keyed, "key-alice")
    streamed = complete(keyed, "key-alice", stream=True, stream_options={"include_usage": True})
    assert streamed["choices"][0]["text"] == whole["choices"][0]["text"]
    assert "suffix_cache" in streamed["speculation"]["per_source"]


def test_metrics_show_the_cache_and_its_origin(keyed):
    complete(keyed, "key-alice")
    metrics = httpx.get(keyed.base + "/metrics", headers={"authorization": "Bearer key-alice"}).text
    assert 'source="suffix_cache"' in metrics
    tokens = next(line for line in metrics.splitlines() if line.startswith("foretell_draft_cache_tokens "))
    assert float(tokens.split()[1]) == cache_of(keyed).snapshot()["cached_tokens"] > 0


def test_global_scope_shares_and_off_has_no_cache(tiny_model_folder):
    with serve(tiny_app(tiny_model_folder, draft_cache_scope="global"), "draft-cache-global") as served:
        complete(served, "any", user="a")
        complete(served, "any", user="b")
        assert cache_of(served).cached_requests("global") == 2
    with serve(tiny_app(tiny_model_folder, draft_cache_scope="off"), "draft-cache-off") as served:
        assert cache_of(served) is None
        assert "suffix_cache" not in complete(served, "any")["speculation"]["per_source"]
