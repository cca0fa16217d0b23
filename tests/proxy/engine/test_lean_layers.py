"""Gemma 3's decoder layer as one function (proxy/engine/lean_layers.py): the same bits as
transformers' layers in every pass the engine runs, taken only where the probe at start shows it,
and out of the way of any other cache and any other family."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from foretell.proxy.engine import GenerationRequest, SpeculativeEngine, lean_layers
from foretell.proxy.engine.forward import forward_pass
from foretell.proxy.engine.invariant_linear import fbgemm_available
from foretell.proxy.engine.precision import quantize_weights
from tests.helpers import GREEDY_PROMPT, greedy_reference

pytestmark = pytest.mark.skipif(not fbgemm_available(), reason="int8 x int8 needs FBGEMM (x86 torch)")


def _int8(model, lean: bool | None = None):
    model = copy.deepcopy(model)
    quantize_weights(model, "int8")
    if lean is not None:
        model.foretell_lean_layers = lean  # decided beforehand: the engine takes it as it is
    return model


def _lean_layers(model) -> list:
    return [m for m in model.modules() if type(m).__name__ == "Gemma3DecoderLayer" and "forward" in vars(m)]


@pytest.fixture(scope="module")
def engines(tiny_model, tokenizer):
    """The tiny Gemma 3 at int8 x int8 twice: with the one-function layers, and with its own."""
    lean = SpeculativeEngine(_int8(tiny_model), tokenizer)
    own = SpeculativeEngine(_int8(tiny_model, lean=False), tokenizer)
    assert lean.lean_layers and not own.lean_layers
    assert len(_lean_layers(lean.model)) == tiny_model.config.num_hidden_layers and not _lean_layers(own.model)
    return lean, own


@torch.inference_mode()
def test_every_pass_gives_the_layers_own_bits(engines):
    """A prefill in two chunks, a verify pass of several rows and a decoding row, past the sliding
    window of the tiny model: every logit equal."""
    lean, own = engines
    ids = torch.randint(10, 1000, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    outputs = []
    for engine in (lean, own):
        blocks = engine.cache.reserve(len(ids), len(ids))
        try:
            passes = [ids[:70], ids[70:140], ids[140:149], ids[149:]]
            logits = []
            for tokens in passes:
                logits.append(forward_pass(engine.model, engine.cache, [(blocks, tokens, 0)], engine.fp32_head))
                blocks.committed += len(tokens)
            outputs.append(logits)
        finally:
            engine.cache.free(blocks)
    for a, b in zip(*outputs):
        assert torch.equal(a, b)


def test_texts_and_logprobs_are_the_layers_own(engines, tokenizer, greedy):
    lean, own = engines
    ids = tokenizer(GREEDY_PROMPT)["input_ids"]
    for options in ({}, {"prediction": greedy}, {"prompt_lookup": True}):
        a, b = (engine.generate(GenerationRequest(prompt_ids=ids, max_tokens=40, logprobs=2, **options))
                for engine in (lean, own))
        assert a.token_ids == b.token_ids and a.text == b.text, options
        assert [(t.logprob, t.top) for t in a.logprobs] == [(t.logprob, t.top) for t in b.logprobs], options


def test_another_cache_gets_the_layers_own_code(engines):
    """transformers' generate (its own cache) through the one-function layers: as without them."""
    lean, own = engines
    prompt = [2, 651, 1234, 88, 9012, 17]
    assert greedy_reference(lean.model, prompt, 12) == greedy_reference(own.model, prompt, 12)


def test_a_copied_model_computes_with_its_own_layers(engines, tokenizer):
    """The one function is bound to its layer: a deep copy of the model runs the copy's weights
    (a closure over the first model's modules would keep running those)."""
    lean, _ = engines
    copied = copy.deepcopy(lean.model)
    for layer, original in zip(_lean_layers(copied), _lean_layers(lean.model)):
        assert layer.forward.__self__ is layer and layer is not original
    with torch.no_grad():
        for layer in _lean_layers(copied):
            layer.post_feedforward_layernorm.weight.add_(0.5)  # (1 + w) times the normed rows
    engine = SpeculativeEngine(copied, tokenizer)
    assert engine.lean_layers
    ids = [2, 651, 1234, 88, 9012, 17]
    copy_logits, original_logits = (
        _one_pass(e, ids) for e in (engine, lean))
    assert not torch.equal(copy_logits, original_logits)


@torch.inference_mode()
def _one_pass(engine, ids):
    blocks = engine.cache.reserve(len(ids), len(ids))
    try:
        return forward_pass(engine.model, engine.cache, [(blocks, ids, 0)], engine.fp32_head)
    finally:
        engine.cache.free(blocks)


def test_a_layer_function_that_computes_otherwise_is_not_taken(tiny_model, tokenizer, monkeypatch, caplog):
    """The probe at start compares logits bit for bit: a rotation with the halves' signs swapped
    (a plausible slip) must be caught, and the layers keep their own code."""
    def swapped(x):
        half = x.shape[-1] // 2
        return torch.cat((x[..., half:], -x[..., :half]), dim=-1)

    monkeypatch.setattr(lean_layers, "_rotate_half", swapped)
    with caplog.at_level(logging.WARNING, logger="foretell.engine"):
        engine = SpeculativeEngine(_int8(tiny_model), tokenizer)
    assert not engine.lean_layers and not _lean_layers(engine.model)
    assert "its own layers serve" in caplog.text


def test_the_decision_is_made_once_per_model(tiny_model, tokenizer, monkeypatch):
    model = _int8(tiny_model)
    SpeculativeEngine(model, tokenizer)
    probes = []
    monkeypatch.setattr(lean_layers, "_probe", lambda *args: probes.append(args) or [])
    assert SpeculativeEngine(model, tokenizer).lean_layers  # a second engine on the same model
    assert probes == []


def test_float32_and_other_families_keep_transformers_layers(tiny_model, tokenizer):
    assert not SpeculativeEngine(copy.deepcopy(tiny_model), tokenizer).lean_layers  # float32: the oracle's code
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=tokenizer.vocab_size + 64, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    quantize_weights(llama, "int8")
    engine = SpeculativeEngine(llama.eval(), tokenizer)
    assert not engine.lean_layers and getattr(llama, "foretell_lean_layers") is False
