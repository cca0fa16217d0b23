"""The engine's kernel path (``FORETELL_KERNELS=triton``, here under Triton's interpreter) against
its loop path (``reference``): the same tokens, one attention launch per layer, at most one
verify launch per kind per step; and the start-up self-check's fallback when a kernel fails."""

from __future__ import annotations

import importlib
import logging
import time

import pytest
import torch
from fastapi.testclient import TestClient

from foretell.kernels import LAUNCHES
from foretell.proxy.engine import GenerationRequest, SpeculativeEngine
from foretell.proxy.engine import kernel_choice
from foretell.proxy.engine.scheduler import Scheduler
from foretell.proxy.server import ServerSettings, create_app
from foretell.proxy.server.app import LocalModel

greedy_module = importlib.import_module("foretell.kernels.greedy_verify")
attention_module = importlib.import_module("foretell.kernels.paged_attention")

PROMPTS = ["def total(items):\n    result = 0\n", "The quick brown fox", "x = [1, 2, 3]\nfor"]


@pytest.fixture(scope="module")
def engines(tiny_model, tokenizer):
    # Small prefill chunks and blocks: several steps mix prefill chunks with verify rows, and
    # the sliding window (8) is crossed with blocks released behind it.
    options = dict(kv_cache_tokens=2048, block_size=4, prefill_chunk=7, max_sequences=4)
    return (SpeculativeEngine(tiny_model, tokenizer, kernels="reference", **options),
            SpeculativeEngine(tiny_model, tokenizer, kernels="triton", **options))


def run_together(engine, requests):
    """Every request in the same steps; returns each one's tokens and the launches of each step."""
    sequences = [engine.add(request) for request in requests]
    tokens = {id(seq): [] for seq in sequences}
    launches = []
    while not all(seq.finished for seq in sequences):
        before = dict(LAUNCHES)
        updates = engine.step([seq for seq in sequences if not seq.finished])
        launches.append({name: LAUNCHES[name] - before.get(name, 0) for name in LAUNCHES})
        for update in updates:
            assert update.error is None, update.error
            tokens[id(update.sequence)] += update.token_ids
    return [tokens[id(seq)] for seq in sequences], launches


def requests_for(tokenizer, engine_plain_texts):
    """Greedy requests with predictions (drafts accepted and rejected), one with prompt lookup,
    and two sampled ones with seeds."""
    requests = []
    for prompt, plain in zip(PROMPTS, engine_plain_texts):
        ids = tokenizer(prompt)["input_ids"]
        half = plain[: len(plain) // 2] + " and then something else entirely"
        requests.append(GenerationRequest(prompt_ids=ids, max_tokens=12, prediction=half))
    ids = tokenizer(PROMPTS[0] * 3)["input_ids"]
    requests.append(GenerationRequest(prompt_ids=ids, max_tokens=10, prompt_lookup=True))
    for seed in (1, 2):
        requests.append(GenerationRequest(prompt_ids=ids, max_tokens=8, temperature=0.8, seed=seed,
                                          prediction=PROMPTS[0]))
    return requests


def test_the_kernel_path_gives_the_loop_paths_tokens(engines, tokenizer):
    reference, triton = engines
    assert triton.kernels.triton == ["paged_attention", "greedy_verify", "rejection_sample"]
    assert reference.kernels.triton == [] and triton.kernels.fallbacks == {}
    plain = [reference.generate(GenerationRequest(prompt_ids=tokenizer(p)["input_ids"], max_tokens=12)).text
             for p in PROMPTS]
    want, _ = run_together(reference, requests_for(tokenizer, plain))
    got, launches = run_together(triton, requests_for(tokenizer, plain))
    assert got == want
    layers = triton.model.config.num_hidden_layers
    assert all(step["paged_attention"] == layers for step in launches), launches
    assert all(step.get("greedy_verify", 0) <= 1 and step.get("rejection_sample", 0) <= 1 for step in launches)
    # Some steps verified both kinds at once, each in its one launch.
    assert any(step.get("greedy_verify") == 1 and step.get("rejection_sample") == 1 for step in launches)


def test_the_kernel_paths_logits_equal_the_loops(engines, tokenizer):
    """Logits of a mixed step (a prefill chunk beside verify rows) through each path."""
    reference, triton = engines
    ids = tokenizer(PROMPTS[0] * 2)["input_ids"]
    logits = []
    for engine in (reference, triton):
        first, second = engine.add(GenerationRequest(prompt_ids=ids, max_tokens=4)), None
        engine.step([first])  # a prefill chunk; the rest of the prompt waits
        second = engine.add(GenerationRequest(prompt_ids=ids[:5], max_tokens=4))
        feeds = [(first.blocks, first.prompt[first.blocks.committed:], 0),
                 (second.blocks, second.prompt[second.blocks.committed:], 0)]
        logits.append(engine._forward(feeds))
        engine.abort(first)
        engine.abort(second)
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)


def broken(*args, **kwargs):
    raise RuntimeError("PTX compilation failed: out of registers")


def test_a_kernel_that_fails_falls_back_to_its_reference(tiny_model, tokenizer, monkeypatch, caplog):
    monkeypatch.setattr(greedy_module, "greedy_verify_triton", broken)
    monkeypatch.setattr(attention_module, "ragged_paged_attention_triton",
                        lambda query, *args, **kwargs: torch.zeros_like(query))  # launches, but wrong
    with caplog.at_level(logging.WARNING, logger="foretell.kernels"):
        engine = SpeculativeEngine(tiny_model, tokenizer, kernels="triton", kv_cache_tokens=1024)
    assert engine.kernels.triton == ["rejection_sample"]
    assert engine.kernels.fallbacks["greedy_verify"] == "RuntimeError: PTX compilation failed: out of registers"
    assert "differs from the reference" in engine.kernels.fallbacks["paged_attention"]
    assert engine.cache.attention_kernel is None  # the per-sequence loop attends
    lines = [r.getMessage() for r in caplog.records]
    assert any("greedy_verify failed its start-up check (RuntimeError: PTX compilation failed" in line
               for line in lines), lines
    assert any("paged_attention failed its start-up check" in line for line in lines), lines
    ids = tokenizer(PROMPTS[1])["input_ids"]
    plain = SpeculativeEngine(tiny_model, tokenizer, kernels="reference", kv_cache_tokens=1024)
    request = GenerationRequest(prompt_ids=ids, max_tokens=6)
    assert engine.generate(request).token_ids == plain.generate(request).token_ids


def test_health_and_metrics_show_the_fallback(tiny_model, tokenizer, monkeypatch):
    monkeypatch.setattr(greedy_module, "greedy_verify_triton", broken)

    def load(metrics):
        engine = SpeculativeEngine(tiny_model, tokenizer, kernels="triton", kv_cache_tokens=1024)
        return LocalModel(_Loaded(tokenizer), Scheduler(engine), "tiny")

    with TestClient(create_app(ServerSettings(), load_local=load), base_url="http://127.0.0.1") as client:
        deadline = time.time() + 120
        while client.get("/health").status_code != 200:
            assert time.time() < deadline
            time.sleep(0.1)
        kernels = client.get("/health").json()["kernels"]
        metrics = client.get("/metrics").text
    assert kernels["mode"] == "triton"
    assert kernels["triton"] == ["paged_attention", "rejection_sample"]
    assert kernels["fallback"] == {"greedy_verify": "RuntimeError: PTX compilation failed: out of registers"}
    assert 'foretell_kernel_fallback{kernel="greedy_verify"} 1.0' in metrics
    assert 'foretell_kernel_fallback{kernel="paged_attention"} 0.0' in metrics


class _Loaded:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer


def test_kernel_modes(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("FORETELL_KERNELS", raising=False)
    assert kernel_choice.resolve_mode(None, cpu) is False  # auto: the references on a CPU
    assert kernel_choice.resolve_mode("reference", cpu) is False
    assert kernel_choice.resolve_mode("triton", cpu) is True  # the interpreter is active here
    monkeypatch.setenv("FORETELL_KERNELS", "triton")
    assert kernel_choice.resolve_mode(None, cpu) is True
    with pytest.raises(ValueError, match="auto, triton, reference"):
        kernel_choice.resolve_mode("fast", cpu)
    monkeypatch.setattr(kernel_choice, "_interpreted", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        kernel_choice.resolve_mode("triton", cpu)


def test_the_self_check_catches_a_kernel_that_ignores_the_window():
    """The check crosses a short window with released blocks, so a kernel wrong only on sliding
    layers is caught too (Gemma 3's own window, 512, is longer than the check's sequences)."""
    def no_window(*args, window=None, **kwargs):
        return attention_module.ragged_paged_attention_triton(*args, window=None, **kwargs)

    shape = kernel_choice.AttentionShape(heads=4, kv_heads=1, head_dim=32, block_size=4, window=512)
    cpu = torch.device("cpu")
    assert kernel_choice.self_check("paged_attention", attention_module.ragged_paged_attention_triton, cpu,
                                    torch.float32, shape) is None
    problem = kernel_choice.self_check("paged_attention", no_window, cpu, torch.float32, shape)
    assert problem is not None and "window 7" in problem, problem
