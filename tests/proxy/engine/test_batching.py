"""Exactness under batching: every request's tokens with others in flight equal its tokens alone.

Requests mix predictions (perfect, edited, useless), prompt lookup, plain decoding, stop strings
and max_tokens; they run at concurrency 1, 4 and 8 through the same admit-then-step loop as the
scheduler. fp32 arithmetic over a batch of a different shape may flip an exact near-tie: a
divergence is allowed only where the target's top-2 logit margin at the first differing token is
below 1e-3 (tests/helpers.py), and the number of diverging cases is reported.
"""

from __future__ import annotations

import random

import pytest

from foretell.proxy.engine import GenerationRequest, SpeculativeEngine
from tests.helpers import assert_greedy_equal, greedy_reference

NEAR_TIE = 1e-3


def run_concurrently(engine, requests, concurrency: int, rng: random.Random | None = None):
    """Results in request order, at most ``concurrency`` sequences per step; with ``rng`` the
    admission order is shuffled, so each request meets different neighbours."""
    order = list(range(len(requests)))
    if rng is not None:
        rng.shuffle(order)
    waiting, running, results = list(order), {}, [None] * len(requests)
    while waiting or running:
        while waiting and len(running) < concurrency:
            index = waiting[0]
            seq = engine.add(requests[index])
            if seq is None:
                break
            running[id(seq)] = (index, seq)
            waiting.pop(0)
        updates = engine.step([seq for _, seq in running.values()])
        for update in updates:
            assert update.error is None, update.error
            if update.result is not None:
                index, _ = running.pop(id(update.sequence))
                results[index] = update.result
    return results


def edit_requests(tokenizer, reference_texts, prompts, max_tokens):
    """A mixed workload over ``prompts`` (token ids) and their solo greedy texts."""
    requests = []
    for i, (prompt, text) in enumerate(zip(prompts, reference_texts)):
        third = len(text) // 3
        kind = i % 6
        if kind == 0:
            requests.append(GenerationRequest(prompt_ids=prompt, max_tokens=max_tokens, prediction=text))
        elif kind == 1:  # an edited prediction: the output inserts text the prediction lacks
            requests.append(GenerationRequest(prompt_ids=prompt, max_tokens=max_tokens,
                                              prediction=text[:third] + text[2 * third:]))
        elif kind == 2:
            requests.append(GenerationRequest(prompt_ids=prompt, max_tokens=max_tokens, prompt_lookup=True))
        elif kind == 3:
            requests.append(GenerationRequest(prompt_ids=prompt, max_tokens=max_tokens))
        elif kind == 4:  # a stop string inside what a perfect prediction drafts
            stop = text[len(text) // 2: len(text) // 2 + 4]
            requests.append(GenerationRequest(prompt_ids=prompt, max_tokens=max_tokens, prediction=text,
                                              stop=(stop,) if stop.strip() else ()))
        else:  # a useless prediction, and a short max_tokens
            requests.append(GenerationRequest(prompt_ids=prompt, max_tokens=max_tokens // 2,
                                              prediction="lorem ipsum dolor sit amet " * 8))
    return requests


def check_batched_equals_alone(engine, model, requests, levels=(4, 8), seed=0):
    alone = run_concurrently(engine, requests, 1)
    diverged = 0
    rng = random.Random(seed)
    for level in levels:
        batched = run_concurrently(engine, requests, level, rng)
        for request, solo, got in zip(requests, alone, batched):
            if got.token_ids != solo.token_ids:
                diverged += 1
                # The solo run is exact (tests/proxy/engine/test_engine_exactness.py); a batched one may
                # part from it only at a near tie.
                common = min(len(got.token_ids), len(solo.token_ids))
                assert_greedy_equal(model, request.prompt_ids, got.token_ids[:common],
                                    solo.token_ids[:common], NEAR_TIE)
            else:
                assert got.text == solo.text and got.finish_reason == solo.finish_reason
            assert len(got.token_origins) == len(got.token_ids)
            assert got.stats.accepted_tokens <= got.stats.completion_tokens
    return alone, diverged


def test_tiny_model_batched_equals_alone(tiny_model, tokenizer):
    engine = SpeculativeEngine(tiny_model, tokenizer, kv_cache_tokens=8192, prefill_chunk=64)
    words = ["alpha", "beta", "gamma", "delta", "total", "items", "value", "result", "line",
             "parse", "key", "split", "strip", "return", "def", "for", "if", "else"]
    rng = random.Random(7)
    prompts = []
    for i in range(24):
        body = " ".join(rng.choice(words) for _ in range(rng.randint(5, 60)))
        prompts.append(tokenizer(f"def f{i}(x):\n    {body}\n")["input_ids"])
    texts = [tokenizer.decode(greedy_reference(tiny_model, p, 32), skip_special_tokens=True) for p in prompts]
    requests = edit_requests(tokenizer, texts, prompts, 32)
    alone, diverged = check_batched_equals_alone(engine, tiny_model, requests, levels=(4, 8))
    print(f"tiny model: {diverged} of {2 * len(requests)} batched runs diverged at a near tie")
    # The solo runs are the oracle's tokens (greedy with the same cut where a stop applies).
    for request, result in zip(requests[3::6], alone[3::6]):
        assert result.token_ids == greedy_reference(tiny_model, request.prompt_ids, request.max_tokens)
    assert sum(r.stats.accepted_tokens for r in alone) > 0
    assert engine.cache.usage() < 1.0  # every finished sequence gave its blocks back
    full = engine.cache.pools["full_attention"]
    held = {e.blocks["full_attention"] for e in engine.cache.prefix.values()}
    assert all(full.refs[b] == (1 if b in held else 0) for b in range(full.num_blocks))


def test_seeded_sampling_is_the_same_whatever_is_in_flight(tiny_model, tokenizer):
    engine = SpeculativeEngine(tiny_model, tokenizer, kv_cache_tokens=8192)
    prompt = tokenizer("def total(items):\n    result = 0\n")["input_ids"]
    text = tokenizer.decode(greedy_reference(tiny_model, prompt, 30), skip_special_tokens=True)
    sampled = GenerationRequest(prompt_ids=prompt, max_tokens=30, prediction=text, temperature=0.05,
                                top_k=40, seed=11)
    alone = run_concurrently(engine, [sampled], 1)[0]
    noise = [GenerationRequest(prompt_ids=tokenizer(f"x{i} = {i}\n" * (i + 1))["input_ids"], max_tokens=25,
                               temperature=1.0 if i % 2 else 0.0, prompt_lookup=True) for i in range(6)]
    crowded = run_concurrently(engine, noise[:3] + [sampled] + noise[3:], 7)[3]
    assert crowded.token_ids == alone.token_ids
    assert alone.stats.drafted_tokens > 0


def test_a_request_that_can_never_fit_is_refused(tiny_model, tokenizer):
    engine = SpeculativeEngine(tiny_model, tokenizer, kv_cache_tokens=256, prefill_chunk=32)
    with pytest.raises(ValueError, match="kv-cache-tokens"):
        engine.add(GenerationRequest(prompt_ids=[2] + [10] * 300, max_tokens=10))
    small = engine.add(GenerationRequest(prompt_ids=[2, 10, 11], max_tokens=10))
    assert small is not None


def test_long_prompts_prefill_in_chunks_without_stalling_others(tiny_model, tokenizer):
    engine = SpeculativeEngine(tiny_model, tokenizer, kv_cache_tokens=8192, prefill_chunk=32)
    short = engine.add(GenerationRequest(prompt_ids=tokenizer("a b c")["input_ids"], max_tokens=20))
    long_prompt = tokenizer("one two three four " * 60)["input_ids"]
    long = engine.add(GenerationRequest(prompt_ids=long_prompt, max_tokens=5))
    steps_with_short_tokens = 0
    while not short.finished:
        before = long.blocks.committed
        updates = engine.step([short, long])
        steps_with_short_tokens += any(u.sequence is short and u.token_ids for u in updates)
        if long.uncached_prompt > 0:  # still prefilling: one chunk per step at most
            assert 0 < long.blocks.committed - before <= 32
    # The short stream got a token every step while the long prompt was prefilled 32 at a time.
    assert steps_with_short_tokens == engine_steps_for(short)
    assert short.output.keys == greedy_reference(tiny_model, short.prompt, 20)


def engine_steps_for(seq) -> int:
    return seq.stats.target_passes


@pytest.mark.embedded
def test_embedded_model_batched_equals_alone(embedded):
    """>= 20 prompts of the edit workload on the real model, at concurrency 1, 4 and 8."""
    tokenizer = embedded.tokenizer
    engine = SpeculativeEngine(embedded.model, tokenizer, kv_cache_tokens=65536)
    import bisect as bisect_module
    import heapq as heapq_module

    sources = [open(bisect_module.__file__).read(), open(heapq_module.__file__).read()]
    lines = [line for source in sources for line in source.splitlines(keepends=True)]
    prompts = []
    for i in range(20):
        start = (i * 37) % (len(lines) - 20)
        snippet = "".join(lines[start:start + 6 + i % 5])
        prompts.append(tokenizer(f"Here is a file:\n\n{snippet}\n\nHere is the file again:\n\n")["input_ids"])
    # Each prompt's plain text builds the predictions of the workload; decoded 8 at a time (a
    # third of the time of one at a time), it is the solo text but at a near tie, and a prediction
    # that parts from the output at a near tie is still a valid workload.
    plain = run_concurrently(engine, [GenerationRequest(prompt_ids=p, max_tokens=24) for p in prompts], 8)
    requests = edit_requests(tokenizer, [r.text for r in plain], prompts, 24)
    _, diverged = check_batched_equals_alone(engine, embedded.model, requests, levels=(4, 8))
    print(f"embedded model: {diverged} of {2 * len(requests)} batched runs diverged at a near tie")


def test_sliding_layers_keep_only_their_window(tiny_model, tokenizer):
    # The sliding pool holds 14 blocks of 4 positions: a 150-token answer must recycle them.
    engine = SpeculativeEngine(tiny_model, tokenizer, kv_cache_tokens=1024, block_size=4,
                               prefill_chunk=16, max_sequences=1, max_draft_positions=16)
    assert engine.cache.pools["sliding_attention"].num_blocks == 14
    prompt = tokenizer("one two three")["input_ids"]
    result = engine.generate(GenerationRequest(prompt_ids=prompt, max_tokens=150, max_draft=8))
    assert result.token_ids == greedy_reference(tiny_model, prompt, 150)
    assert engine.cache._promised == {"full_attention": 0, "sliding_attention": 0}


def test_n_siblings_share_the_first_choices_cached_prompt(tiny_model, tokenizer):
    """``n > 1`` choices: the first prefills the prompt, the others wait for its blocks to be
    cached and reuse them (their ``cached_tokens`` say so), through the scheduler as served."""
    import asyncio

    from foretell.proxy.engine.scheduler import DoneEvent, ErrorEvent, Scheduler

    engine = SpeculativeEngine(tiny_model, tokenizer, kv_cache_tokens=4096)  # an empty prefix cache
    prompt = tokenizer("def siblings(n):\n    return [choice(i) for i in range(n)]\n" * 3)["input_ids"]
    scheduler = Scheduler(engine)

    async def run():
        job = scheduler.submit([GenerationRequest(prompt_ids=prompt, max_tokens=4) for _ in range(3)])
        results = {}
        while len(results) < 3:
            event = await asyncio.wait_for(job.events.get(), timeout=120)
            assert not isinstance(event, ErrorEvent), event.error
            if isinstance(event, DoneEvent):
                results[event.choice] = event.result
        return results

    try:
        results = asyncio.run(run())
    finally:
        scheduler.close()
    block = engine.cache.block_size
    shared = (len(prompt) - 1) // block * block  # the prompt's complete blocks but the last token
    assert shared >= 2 * block
    assert [results[i].stats.cached_tokens for i in range(3)] == [0, shared, shared]
    assert results[0].token_ids == results[1].token_ids == results[2].token_ids


def test_a_long_predictions_usage_is_counted_off_the_engines_thread(tiny_model, tokenizer, monkeypatch):
    """Nothing slow on the step thread (issue 29): a prediction tokenised by the caller is used as
    given, and a long prediction's usage (a diff, a second for a megabyte) is counted by the
    finisher, in a child process, before ``on_result`` and the DoneEvent, with the figures the
    engine alone computes."""
    import asyncio
    import threading

    from foretell.proxy import prediction_usage
    from foretell.proxy.engine import speculation
    from foretell.proxy.engine.draft_sources import PredictionEncoding
    from foretell.proxy.engine.scheduler import DoneEvent, ErrorEvent, Scheduler

    engine = SpeculativeEngine(tiny_model, tokenizer, kv_cache_tokens=4096)
    prompt = tokenizer("Repeat the file:\n")["input_ids"]
    prediction = "".join(f"line {i}: value = {i * 7 % 13}\n" for i in range(2000))
    assert len(prediction) >= prediction_usage.CHILD_PROCESS_CHARS
    request = GenerationRequest(prompt_ids=prompt, max_tokens=24, prediction=prediction,
                                prediction_encoding=PredictionEncoding.of(tokenizer, prediction))
    alone = engine.generate(GenerationRequest(prompt_ids=prompt, max_tokens=24, prediction=prediction))
    counted_on = []  # the threads that tokenised the prediction or counted its usage in this process

    def spy(*args):
        counted_on.append(threading.current_thread().name)
        return prediction_usage.prediction_token_usage(*args)
    monkeypatch.setattr(speculation, "prediction_token_usage", spy)
    encode = PredictionEncoding.of.__func__
    monkeypatch.setattr(PredictionEncoding, "of", classmethod(
        lambda cls, *args: counted_on.append("tokenised on " + threading.current_thread().name) or encode(cls, *args)))
    reported = []
    scheduler = Scheduler(engine, on_result=lambda result: reported.append(
        (threading.current_thread().name, result.stats.accepted_prediction_tokens,
         result.stats.rejected_prediction_tokens)))

    async def run():
        job = scheduler.submit(request)
        while True:
            event = await asyncio.wait_for(job.events.get(), timeout=120)
            assert not isinstance(event, ErrorEvent), event.error
            if isinstance(event, DoneEvent):
                return event.result

    try:
        result = asyncio.run(run())
    finally:
        scheduler.close()
    assert result.token_ids == alone.token_ids
    usage = (alone.stats.accepted_prediction_tokens, alone.stats.rejected_prediction_tokens)
    assert sum(usage) == len(request.prediction_encoding.token_ids) > 0
    assert (result.stats.accepted_prediction_tokens, result.stats.rejected_prediction_tokens) == usage
    assert len(reported) == 1 and reported[0][0].startswith("foretell-finish") and reported[0][1:] == usage
    assert counted_on == []  # neither the engine's thread nor the finisher: the child process did
    assert prediction_usage._child.process is not None and prediction_usage._child.process.poll() is None


def test_a_failing_result_callback_still_answers_the_request(tiny_model, tokenizer, caplog):
    """The finisher answers every request even when ``on_result`` (the metrics) raises: a bug
    there is logged, never a request left waiting for its DoneEvent."""
    import asyncio

    from foretell.proxy.engine.scheduler import DoneEvent, Scheduler

    def broken(result):
        raise RuntimeError("metrics bug")

    engine = SpeculativeEngine(tiny_model, tokenizer, kv_cache_tokens=1024)
    scheduler = Scheduler(engine, on_result=broken)

    async def run():
        job = scheduler.submit(GenerationRequest(prompt_ids=tokenizer("def f(x):")["input_ids"], max_tokens=4))
        while not isinstance(event := await asyncio.wait_for(job.events.get(), timeout=120), DoneEvent):
            pass
        return event.result

    try:
        result = asyncio.run(run())
    finally:
        scheduler.close()
    assert result.stats.completion_tokens == 4
    assert any("finishing a result failed" in r.getMessage() and r.exc_info for r in caplog.records)
