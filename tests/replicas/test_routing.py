"""The replicas' parts that need no Ray: the routing hint against the engine's own tokens, the
affinity policy, round-robin, the in-process ASGI call, the merged metrics and the options."""

from __future__ import annotations

import asyncio
import random

import pytest
from prometheus_client.parser import text_string_to_metric_families

from foretell.proxy.replicas.asgi_call import ForwardedRequest, ResponseStart, call_app
from foretell.proxy.replicas.cluster_metrics import merge_metrics
from foretell.proxy.replicas.options import ReplicaOptions
from foretell.proxy.replicas.routing import (BLOCK_SIZE, MAX_BLOCKS, AffinityTable, RoundRobin, block_hashes,
                                             prompt_hint, rank_by_affinity)
from foretell.proxy.server.metrics import Metrics
from foretell.proxy.server.prompts import request_prompt_ids
from foretell.proxy.server.schema import ChatCompletionRequest, CompletionRequest
from foretell.proxy.server.tool_calls.format import tool_plan


def test_block_hashes_chain_whole_blocks_only():
    ids = list(range(50))
    hashes = block_hashes(ids)
    assert len(hashes) == 50 // BLOCK_SIZE  # the partial last block is not hashed
    assert block_hashes(ids[:48]) == hashes
    changed = block_hashes([999] + ids[1:])
    assert all(a != b for a, b in zip(hashes, changed))  # a change early changes every later hash
    assert block_hashes(ids[:32] + [7] * 18)[:2] == hashes[:2]
    assert len(block_hashes(list(range(BLOCK_SIZE * (MAX_BLOCKS + 5))))) == MAX_BLOCKS


@pytest.mark.parametrize("body", [
    {"model": "m", "prompt": "def parse(text):\n    " * 40},
    {"model": "m", "prompt": ["Schöne Grüße, 東京 🗼 " * 30]},
    {"model": "m", "prompt": [list(range(100, 140))]},
    {"model": "m", "prompt": list(range(100, 180))},
    {"model": "m", "messages": [{"role": "system", "content": "You edit code. " * 20},
                                {"role": "user", "content": "Rename x to y in: x = 1\n" * 10}]},
    # The tools lead the prompt (foretell's instructions in a system turn); no BOS where asked.
    {"model": "m", "messages": [{"role": "user", "content": "Rename x to y in: x = 1\n" * 10}],
     "tools": [{"type": "function", "function": {"name": "write_file", "description": "Write a file. " * 8}}]},
    {"model": "m", "prompt": "def f(x):\n    return x\n" * 20, "add_special_tokens": False},
])
def test_the_hint_hashes_the_tokens_a_replica_prefills(tokenizer, body):
    chat = "messages" in body
    path = "/v1/chat/completions" if chat else "/v1/completions"
    parsed = (ChatCompletionRequest if chat else CompletionRequest).model_validate(body)
    if not chat and isinstance(parsed.prompt, list) and isinstance(parsed.prompt[0], (str, list)):
        parsed.prompt = parsed.prompt[0]  # a list of one prompt
    engine_ids = request_prompt_ids(tokenizer, parsed, chat, context=None, tools=tool_plan(body) if chat else None)
    hint = prompt_hint(tokenizer, path, body)
    assert hint and hint == block_hashes(engine_ids)


def test_a_huge_prompt_is_hinted_from_its_start_only(tokenizer):
    text = "lorem ipsum dolor sit amet " * 20_000  # 540k characters
    hint = prompt_hint(tokenizer, "/v1/completions", {"model": "m", "prompt": text})
    assert hint == block_hashes(tokenizer(text[:20_000])["input_ids"]) and len(hint) == MAX_BLOCKS


def test_a_request_that_does_not_validate_gets_no_hint(tokenizer):
    assert prompt_hint(tokenizer, "/v1/completions", {"model": "m", "prompt": 5}) == []
    assert prompt_hint(tokenizer, "/v1/chat/completions", {"model": "m"}) == []


def test_affinity_keeps_a_prefix_on_its_replica_until_the_load_is_uneven():
    table = AffinityTable()
    shared = block_hashes(list(range(64)))
    table.record(shared[:3], "a")
    longer = shared + block_hashes(list(range(64)) + [5] * 16)[4:]
    assert rank_by_affinity(table, longer, {"a": 3, "b": 0}, imbalance=4)[0] == ["a"]
    assert rank_by_affinity(table, longer, {"a": 5, "b": 0}, imbalance=4)[0] == ["b"]  # sheds
    # The longest chain wins: b took the whole prompt later.
    table.record(shared, "b")
    assert table.match(shared) == ("b", 4)
    assert rank_by_affinity(table, shared, {"a": 0, "b": 2}, imbalance=4)[0] == ["b"]


def test_new_prefixes_go_to_the_least_busy_then_to_the_replica_holding_least():
    """Seeded draws: the fewest-hashes tie rule, not chance, must decide every load tie."""
    table = AffinityTable()
    table.record(block_hashes(list(range(32))), "a")  # a holds 2 hashes
    table.record(block_hashes(list(range(200, 216))), "b")  # b holds 1, c none
    fresh = block_hashes(list(range(100, 132)))
    for seed in range(20):
        rng = random.Random(seed)
        assert rank_by_affinity(table, fresh, {"a": 0, "b": 1, "c": 1}, imbalance=4, rng=rng)[0] == ["a"]
        assert rank_by_affinity(table, fresh, {"a": 0, "b": 0, "c": 0}, imbalance=4, rng=rng) == \
            [["c"], ["b", "a"]]
        assert rank_by_affinity(table, [], {"a": 2, "b": 1, "c": 3}, imbalance=4, rng=rng)[0] == ["b"]
    # Equal on load and on what they hold: either, not always the same one.
    even = {"a": 0, "b": 0, "c": 0}
    table.forget("a")
    table.forget("b")
    rng = random.Random(0)
    firsts = {rank_by_affinity(table, [], even, imbalance=4, rng=rng)[0][0] for _ in range(50)}
    assert firsts == {"a", "b", "c"}


def test_the_affinity_owner_keeps_a_request_at_exactly_the_imbalance_and_sheds_one_past_it():
    """The shedding bound is inclusive, measured from the least busy replica (not from zero)."""
    table = AffinityTable()
    prompt = block_hashes(list(range(64)))
    table.record(prompt, "a")
    assert rank_by_affinity(table, prompt, {"a": 6, "b": 2, "c": 3}, imbalance=4) == [["a"], ["b", "c"]]
    assert rank_by_affinity(table, prompt, {"a": 7, "b": 2, "c": 3}, imbalance=4)[0] == ["b"]
    assert rank_by_affinity(table, prompt, {"a": 0, "b": 0}, imbalance=0)[0] == ["a"]
    assert rank_by_affinity(table, prompt, {"a": 1, "b": 0}, imbalance=0)[0] == ["b"]


def test_the_table_forgets_a_replica_and_stays_within_its_capacity():
    table = AffinityTable(capacity=5)
    table.record(block_hashes(list(range(48))), "a")
    table.record(block_hashes(list(range(100, 148))), "b")
    assert len(table.owner) == 5 and table.held == {"a": 2, "b": 3}
    table.forget("b")
    assert set(table.owner.values()) == {"a"} and "b" not in table.held


def test_round_robin_takes_each_replica_in_turn():
    turns = RoundRobin()
    assert [turns.rank(["b", "a", "c"])[0][0] for _ in range(4)] == ["a", "b", "c", "a"]


async def streaming_app(scope, receive, send):
    """An ASGI app streaming numbered chunks until told to stop, noting a disconnect."""
    assert (await receive())["body"] == b"ping"
    await send({"type": "http.response.start", "status": 201, "headers": [(b"x-kind", b"stream")]})
    try:
        for i in range(1000):
            await send({"type": "http.response.body", "body": f"{i};".encode(), "more_body": True})
            await asyncio.sleep(0.001)
        await send({"type": "http.response.body", "body": b"end", "more_body": False})
    except asyncio.CancelledError:
        streaming_app.cancelled = True
        raise


def test_the_asgi_call_streams_an_answer_and_stops_the_app_when_left_early():
    request = ForwardedRequest("POST", "/x", b"", [], b"ping")

    async def whole():
        return [part async for part in call_app(streaming_app, request)]

    parts = asyncio.run(whole())
    assert parts[0] == ResponseStart(201, [(b"x-kind", b"stream")])
    assert b"".join(parts[1:]).endswith(b"999;end")

    async def leave_early():
        streaming_app.cancelled = False
        stream = call_app(streaming_app, request)
        taken = [await stream.__anext__() for _ in range(4)]
        await stream.aclose()
        return taken

    assert asyncio.run(leave_early())[1:] == [b"0;", b"1;", b"2;"]
    assert streaming_app.cancelled


def test_merged_metrics_label_each_replica_and_sum_the_load():
    replicas = {}
    for name, (waiting, running, usage) in {"r1": (1, 2, 0.25), "r2": (3, 4, 0.75)}.items():
        metrics = Metrics()
        metrics.record_load("tiny", waiting, running, usage)
        replicas[name] = {"waiting": waiting, "running": running, "kv_cache_usage": usage,
                          "metrics": metrics.render().decode()}
    families = {f.name: f for f in text_string_to_metric_families(
        merge_metrics("tiny", Metrics().render().decode(), replicas).decode())}
    waiting = {s.labels["replica"]: s.value for s in families["vllm:num_requests_waiting"].samples}
    assert waiting == {"r1": 1, "r2": 3, "all": 4}
    usage = {s.labels["replica"]: s.value for s in families["vllm:kv_cache_usage_perc"].samples}
    assert usage["all"] == 0.5
    ours = {s.labels["replica"]: s.value for s in families["foretell_num_requests_running"].samples}
    assert ours == {"ingress": 0, "r1": 2, "r2": 4, "all": 6}


def test_replica_options_refuse_impossible_bounds():
    assert ReplicaOptions(replicas=2).autoscaling() is None
    assert ReplicaOptions(replicas=2, max_replicas=4).autoscaling() == \
        {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 2}
    for bad in (ReplicaOptions(replicas=5, max_replicas=4), ReplicaOptions(replicas=1, min_replicas=2)):
        with pytest.raises(ValueError, match="outside"):
            bad.check()
