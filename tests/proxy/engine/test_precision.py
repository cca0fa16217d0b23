"""Precision: dtype choice, the fp32-rescored head, weight-only quantization, and what "the same
text" means per precision (fp32: plain greedy decoding exactly, tested in
test_engine_exactness.py; bf16 and quantized: the same engine's plain decoding at the same
precision, except at near ties)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from foretell.proxy.engine import GenerationRequest, SpeculativeEngine
from foretell.proxy.engine import precision
from foretell.proxy.engine.precision import (
    Int8WeightOnlyLinear,
    describe,
    head_rows,
    quantize_weights,
    rescore_in_fp32,
    resolve_dtype,
)
from tests.helpers import assert_equal_to_own_plain

PROMPT = "def parse(line):\n    key, value = line.split('=')\n    return key.strip(), value\n"
MAX_NEW = 60
# The tiny model's logits are a few tenths; bf16 rounds its activations to 2**-8 of their size,
# so a batched verify can move a logit by ~1e-3. A gap beyond this is no near tie.
TINY_BF16_TIE_EPSILON = 2e-2
# The embedded model's logits are ~10-30: a batched verify in bf16 moves a token's logprob by
# ~0.06, at most ~0.2 on the edit benchmark (docs/benchmarks.md, "Precision").
EMBEDDED_BF16_TIE_EPSILON = 0.25


# ---- the fp32 head against its oracle ---------------------------------------------------------

def _head_case(dtype, rows=16, vocab=5000, width=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, width, generator=generator).to(dtype)  # [n, d]
    weight = torch.randn(vocab, width, generator=generator).to(dtype)  # [V, d]
    # Near ties: rows 0-7 get a second token whose weight differs from the leader's in one low bit.
    exact = F.linear(hidden.float(), weight.float())  # [n, V]
    for row in range(8):
        leader = int(exact[row].argmax())
        twin = (leader + 1 + row) % vocab
        weight[twin] = weight[leader]
        weight[twin, row % width] += (1 if row % 2 else -1) * 2.0 ** -6 * weight[leader, row % width].abs()
    return hidden, weight


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rescored_head_picks_the_fp32_products_argmax(dtype):
    hidden, weight = _head_case(dtype)
    low = F.linear(hidden, weight)  # [n, V] at the weights' precision
    oracle = F.linear(hidden.float(), weight.float())  # [n, V] the float32 products
    scores = rescore_in_fp32(hidden, lambda rows: weight[rows].float(), None, low)
    assert scores.dtype == torch.float32
    assert torch.equal(scores.argmax(dim=-1), oracle.argmax(dim=-1))
    best = scores.argmax(dim=-1)
    torch.testing.assert_close(scores.gather(1, best[:, None]), oracle.gather(1, best[:, None]),
                               rtol=1e-5, atol=1e-5)
    # Away from the top, the low-precision logits are kept (upcast).
    assert torch.equal(scores.min(dim=-1).values, low.float().min(dim=-1).values)


def test_the_rescoring_changes_greedy_tokens_bf16_would_tie():
    """The case it exists for: bf16 logits tie at the top (the first index wins), float32 ones
    do not. Without rescoring, argmax picks a token the float32 products rank second."""
    hidden, weight = _head_case(torch.bfloat16, rows=64, seed=1)
    low = F.linear(hidden, weight)
    oracle = F.linear(hidden.float(), weight.float()).argmax(dim=-1)
    assert not torch.equal(low.float().argmax(dim=-1), oracle)  # bf16 alone gets some wrong
    assert torch.equal(rescore_in_fp32(hidden, lambda rows: weight[rows].float(), None, low).argmax(dim=-1),
                       oracle)


def test_an_int8_head_is_rescored_from_its_dequantized_rows():
    hidden, weight = _head_case(torch.bfloat16, rows=64, seed=2)
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(weight)
    head = Int8WeightOnlyLinear(linear)
    oracle = F.linear(hidden.float(), head.float_rows(torch.arange(weight.shape[0])))  # [n, V]
    scores = rescore_in_fp32(hidden, head_rows(head), None, head(hidden))
    assert torch.equal(scores.argmax(dim=-1), oracle.argmax(dim=-1))


def test_a_flat_row_is_searched_in_full():
    """More candidates than topk returns (a row of equal logits): every one is rescored."""
    hidden = torch.ones(2, 8, dtype=torch.bfloat16)
    weight = torch.full((10000, 8), 0.5, dtype=torch.bfloat16)
    weight[7777, 3] = 0.50390625  # one bf16 step above: its product is the largest
    bias = torch.zeros(10000, dtype=torch.bfloat16)
    scores = rescore_in_fp32(hidden, lambda rows: weight[rows].float(), bias, F.linear(hidden, weight, bias))
    assert scores.argmax(dim=-1).tolist() == [7777, 7777]


def _near_twin_case(bound: float, dtype=torch.float32):
    """A head of 3 tokens over hidden = e_0, so that token j's float32 logit is weight[j, 0]:
    token 0 leads the approximate logits, token 1 is the float32 winner sitting 1.5 bounds below
    it, each approximation within the bound (0.75 of it) of its float32 value."""
    hidden = torch.zeros(1, 4)
    hidden[0, 0] = 1.0
    leader = 16.0
    twin = leader - 1.5 * bound
    weight = torch.zeros(3, 4)
    weight[0, 0] = leader - 0.75 * bound  # float32: a little below the twin's
    weight[1, 0] = twin + 0.75 * bound + 1e-3 * bound
    weight[2, 0] = 3.0
    approx = torch.tensor([[leader, twin, 3.0]], dtype=dtype)
    return hidden, weight, approx


class _FixedBound:
    def __init__(self, value):
        self.value = value

    def largest(self):
        return torch.full((1, 1), self.value)

    def at(self, rows, tokens):
        return torch.full(rows.shape, self.value)


def test_the_rescoring_reaches_a_winner_two_bounds_below():
    """The proof's line is the approximate top minus the leader's bound minus the largest bound:
    a float32 winner 1.5 bounds below the approximate top is found. (A line one bound below, or
    one that drops either term, misses it and keeps the wrong token.)"""
    hidden, weight, approx = _near_twin_case(bound=1.0)
    scores = rescore_in_fp32(hidden, lambda rows: weight[rows], None, approx.clone(), _FixedBound(1.0))
    assert int(scores.argmax()) == 1
    assert float(scores[0, 1]) == pytest.approx(float(weight[1, 0]))
    narrow = rescore_in_fp32(hidden, lambda rows: weight[rows], None, approx.clone(), _FixedBound(0.5))
    assert int(narrow.argmax()) == 0  # the case is sharp: half the bound gets it wrong


def test_the_bf16_rounding_bound_reaches_a_winner_two_bounds_below():
    """The same with a real bf16 head's own bound (|top| * 2**-7 + 1e-3): 16.0 and 15.8125 are
    bf16 values 1.49 bounds apart, and the float32 products put the second first."""
    bound = 16.0 * 2.0 ** -7 + 1e-3
    hidden, weight, _ = _near_twin_case(bound)
    approx = torch.tensor([[16.0, 15.8125, 3.0]], dtype=torch.bfloat16)
    assert float(approx[0, 0] - approx[0, 1]) == pytest.approx(1.49 * bound, abs=0.01 * bound)
    # the inputs honour the bound: each approximation within it of its float32 value
    assert bool(((approx.float() - weight[:, 0]).abs() <= bound).all())
    scores = rescore_in_fp32(hidden, lambda rows: weight[rows], None, approx)
    assert int(scores.argmax()) == 1


def test_the_rescored_products_include_the_bias():
    """Two tokens whose weight products round to one bf16 value; the bias puts the second ahead
    in float32. Rescoring without the bias would give the first (the first index of a tie)."""
    hidden = torch.zeros(1, 4)
    hidden[0, 0] = 1.0
    weight = torch.zeros(2, 4)
    weight[0, 0], weight[1, 0] = 10.0, 9.99
    bias = torch.tensor([0.0, 0.02])
    approx = (F.linear(hidden, weight) + bias).to(torch.bfloat16)
    assert approx[0, 0] == approx[0, 1]  # a tie in bf16
    scores = rescore_in_fp32(hidden, lambda rows: weight[rows], bias, approx)
    assert int(scores.argmax()) == 1
    assert float(scores[0, 1]) == pytest.approx(10.01)


@pytest.mark.skipif(not __import__("foretell.proxy.engine.invariant_linear", fromlist=["x"]).fbgemm_available(),
                    reason="int8 x int8 needs FBGEMM")
def test_an_int8_head_decides_by_float32_products_with_a_bias():
    """The int8 x int8 head through the engine's path: every row's argmax is the float32
    product's (bias included), on near twins its integer product cannot tell apart."""
    from foretell.proxy.engine.invariant_linear import Int8DynamicLinear

    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(32, 64, generator=generator)
    weight = torch.randn(5000, 64, generator=generator)
    bias = torch.randn(5000, generator=generator) * 1e-3
    for row in range(32):  # a twin just below each row's winner, at a lower index
        leader = int((F.linear(hidden[row], weight) + bias).argmax())
        twin = (leader - 1 - row) % 5000
        column = int(hidden[row].abs().argmax())
        weight[twin] = weight[leader]
        weight[twin, column] -= 1e-4 * float(hidden[row, column].sign())
        bias[twin] = bias[leader]
    linear = torch.nn.Linear(64, 5000)
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.bias.copy_(bias)
    head = Int8DynamicLinear(linear, keep_float_rows=True)
    approx = head.product(hidden)
    oracle = F.linear(hidden, weight) + bias
    int8_alone = approx.argmax(dim=-1)
    scores = rescore_in_fp32(hidden, head.float_rows, head.bias, approx,
                             head.error_bound(hidden, head.last_residual_norm))
    assert torch.equal(scores.argmax(dim=-1), oracle.argmax(dim=-1))
    assert not torch.equal(int8_alone, oracle.argmax(dim=-1))  # the integer product alone errs


# ---- dtype choice ----------------------------------------------------------------------------

def test_auto_is_bf16_on_cuda_and_on_a_cpu_with_native_bf16(monkeypatch):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("auto", "cpu") == torch.bfloat16
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype(None, "cuda") == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16, float16"):
        resolve_dtype("fp8", "cpu")


def test_auto_quantize_is_measured_once_per_machine(monkeypatch, tmp_path):
    """--quantize auto: int8 on a CPU where the int8 x int8 kernel beats float32 on the head's
    product, timed once and then read from the calibration folder; none elsewhere; a dtype asked
    for by name keeps its own precision."""
    from foretell.proxy.engine import invariant_linear, kernel_timing

    if not invariant_linear.fbgemm_available():
        pytest.skip("no FBGEMM in this torch build")
    monkeypatch.setenv("FORETELL_CACHE_DIR", str(tmp_path))
    timed = []

    def fake_timing(out, inp):
        timed.append((out, inp))
        return {"float32": 0.04, "int8": 0.006} if out > 1000 else {"float32": 0.001, "int8": 0.002}

    monkeypatch.setattr(kernel_timing, "time_kernels", fake_timing)
    assert precision.resolve_quantize("auto", "cpu", (262144, 640)) == "int8"
    assert precision.resolve_quantize(None, "cpu", (262144, 640)) == "int8"
    assert timed == [(262144, 640)]  # the second answer came from the file
    assert (tmp_path / "calibration" / "int8-kernels.json").is_file()
    assert precision.resolve_quantize("auto", "cpu", (100, 64)) == "none"
    assert precision.resolve_quantize("auto", "cuda", (262144, 640)) == "none"
    assert precision.resolve_quantize("int4", "cpu", (262144, 640)) == "int4"
    assert resolve_dtype("auto", "cpu", "int8") == torch.float32
    monkeypatch.setattr(invariant_linear, "fbgemm_available", lambda: False)
    assert precision.resolve_quantize("auto", "cpu", (262144, 640)) == "none"


def test_the_real_kernel_timing_measures_both_kernels():
    from foretell.proxy.engine import invariant_linear, kernel_timing

    if not invariant_linear.fbgemm_available():
        pytest.skip("no FBGEMM in this torch build")
    timings = kernel_timing.time_kernels(4096, 64)
    assert set(timings) == {"float32", "int8"} and all(t > 0 for t in timings.values())


def test_precision_labels():
    assert describe(torch.float32, "none", True) == "float32"  # no fp32 head over an fp32 body
    assert describe(torch.bfloat16, "none", True) == "bfloat16+fp32-head"
    assert describe(torch.bfloat16, "int4") == "bfloat16/int4"
    assert describe(torch.float32, "int8", True) == "float32/int8+fp32-head"


# ---- quantization ------------------------------------------------------------------------------

def test_invariant_linear_equals_its_dequantized_reference():
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 40, bias=True).to(torch.bfloat16)
    quantized = Int8WeightOnlyLinear(linear)
    x = torch.randn(3, 5, 96, dtype=torch.bfloat16)
    reference = (x.float() @ (quantized.qweight.float() * quantized.scale.float()[:, None]).t()
                 + linear.bias.float())  # [3, 5, 40]
    torch.testing.assert_close(quantized(x).float(), reference, rtol=2e-2, atol=2e-2)
    # and it stays near the unquantized layer (int8 keeps ~1/254 of each row's range)
    torch.testing.assert_close(quantized(x).float(), linear(x).float(), rtol=0.1, atol=0.1)


@pytest.mark.parametrize("integer", [True, False], ids=["int8-activations", "weight-only"])
def test_quantize_replaces_every_linear_layer_the_head_too(tiny_model, integer, monkeypatch):
    """int8 x int8 where FBGEMM runs (q/k/v and gate/up sharing one product of their input),
    else PyTorch's weight-only kernel."""
    from foretell.proxy.engine import invariant_linear

    if integer and not invariant_linear.fbgemm_available():
        pytest.skip("no FBGEMM in this torch build")
    monkeypatch.setattr(invariant_linear, "fbgemm_available", lambda: integer)
    model = copy.deepcopy(tiny_model).to(torch.bfloat16)
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert quantize_weights(model, "int8") == linears
    assert sum(type(m) is torch.nn.Linear for m in model.modules()) == 0
    head = model.get_output_embeddings()
    if integer:
        assert isinstance(head, invariant_linear.Int8DynamicLinear) and head.float_weight is not None
        attention = model.model.layers[0].self_attn
        assert isinstance(attention.k_proj, invariant_linear.SharedInputProjection)
        assert attention.q_proj.group is attention.v_proj.group
        assert model.foretell_batch_invariant
    else:
        assert isinstance(head, Int8WeightOnlyLinear)
        assert not model.foretell_batch_invariant
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16  # the embedding is kept
    assert model.foretell_quantization == "int8"
    with pytest.raises(ValueError, match="quantize must be one of auto, none, int8, int4"):
        quantize_weights(model, "int3")


def test_int8_leaves_layers_its_kernel_cannot_take(monkeypatch):
    """PyTorch's int8 weight-only kernel (without FBGEMM) needs a width divisible by 16 (it
    crashes the process otherwise)."""
    from foretell.proxy.engine import invariant_linear

    monkeypatch.setattr(invariant_linear, "fbgemm_available", lambda: False)
    model = torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.Linear(32, 8)).to(torch.bfloat16)
    model.get_output_embeddings = lambda: None
    assert quantize_weights(model, "int8") == 1
    assert type(model[0]) is torch.nn.Linear and isinstance(model[1], Int8WeightOnlyLinear)
    with pytest.raises(ValueError, match="divisible by 16"):
        Int8WeightOnlyLinear(torch.nn.Linear(24, 8))


def test_int4_quantizes_the_layers_torchao_can_group(tiny_model):
    pytest.importorskip("torchao")
    model = copy.deepcopy(tiny_model).to(torch.bfloat16)
    # The tiny model's widths: 64 (not a multiple of 128: left alone) and 128 (the MLP's down_proj).
    assert quantize_weights(model, "int4") == model.config.num_hidden_layers
    down = model.model.layers[0].mlp.down_proj
    assert type(down.weight) is not torch.nn.Parameter  # a torchao tensor
    ids = torch.tensor([[2, 100, 200]])
    assert torch.isfinite(model(input_ids=ids).logits).all()


# ---- the same text, per precision -------------------------------------------------------------

def _spec_and_plain(engine, prompt_ids, max_new, prediction):
    plain = engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_tokens=max_new))
    spec = engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_tokens=max_new,
                                             prediction=prediction or plain.text, prompt_lookup=True))
    return plain, spec


@pytest.mark.parametrize("mode", ["bfloat16", "bfloat16-bf16-head", "float16", "int8", "int4"])
def test_tiny_model_speculation_equals_its_own_plain_decoding(tiny_model, tokenizer, mode):
    if mode == "int4":
        pytest.importorskip("torchao")
    dtype = torch.float16 if mode == "float16" else torch.bfloat16
    model = copy.deepcopy(tiny_model).to(dtype)
    quantize_weights(model, mode if mode in ("int8", "int4") else "none")
    engine = SpeculativeEngine(model, tokenizer, fp32_head=False if mode == "bfloat16-bf16-head" else None)
    assert engine.dtype == dtype
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    for prediction in (None, PROMPT):  # its own output (all accepted), then a useless one
        plain, spec = _spec_and_plain(engine, prompt_ids, MAX_NEW, prediction)
        assert_equal_to_own_plain(engine, prompt_ids, spec.token_ids, plain.token_ids, TINY_BF16_TIE_EPSILON)
        if prediction is None:  # the speculative path really ran
            assert spec.stats.target_passes < len(spec.token_ids)


def test_the_engine_casts_a_model_and_names_its_precision(tiny_model, tokenizer):
    engine = SpeculativeEngine(copy.deepcopy(tiny_model), tokenizer, dtype=torch.bfloat16)
    assert (engine.dtype, engine.fp32_head, engine.precision) == (torch.bfloat16, True, "bfloat16+fp32-head")
    assert engine.cache.keys[0].dtype == torch.bfloat16
    assert SpeculativeEngine(tiny_model, tokenizer).precision == "float32"

    quantized = copy.deepcopy(tiny_model).to(torch.bfloat16)
    quantize_weights(quantized, "int8")
    assert SpeculativeEngine(quantized, tokenizer).precision == "bfloat16/int8+fp32-head"
    assert SpeculativeEngine(quantized, tokenizer, fp32_head=False).precision == "bfloat16/int8"
    opaque = copy.deepcopy(tiny_model).to(torch.bfloat16)
    opaque.lm_head = torch.nn.Sequential(opaque.lm_head)  # a head whose rows cannot be read back
    assert SpeculativeEngine(opaque, tokenizer).precision == "bfloat16"
    with pytest.raises(ValueError, match="needs an unquantized or int8 output head"):
        SpeculativeEngine(opaque, tokenizer, fp32_head=True)


@pytest.fixture(scope="module")
def embedded_bf16(embedded_folder):  # converted first, under its lock
    from foretell.proxy.engine.model_loader import load_model

    loaded = load_model(None, dtype="bfloat16")
    return loaded, SpeculativeEngine(loaded.model, loaded.tokenizer)


@pytest.mark.embedded
@pytest.mark.parametrize("source", ["prediction+lookup", "lookup"])
def test_embedded_model_in_bf16_equals_its_own_plain_decoding(embedded_bf16, source):
    """The default precision on this CPU, on a real edit: the file before the edit as the
    prediction with prompt lookup, or prompt lookup alone."""
    from pathlib import Path

    loaded, engine = embedded_bf16
    assert engine.precision == "bfloat16+fp32-head"
    edit_dir = Path(__file__).resolve().parents[3] / "examples" / "edit"
    before = (edit_dir / "before.py").read_text()
    prompt_ids = loaded.tokenizer(before + "\n\n" + (edit_dir / "prompt.txt").read_text())["input_ids"]
    plain = engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_tokens=120))
    spec = engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_tokens=120, prompt_lookup=True,
                                             prediction=before if source == "prediction+lookup" else None))
    assert_equal_to_own_plain(engine, prompt_ids, spec.token_ids, plain.token_ids, EMBEDDED_BF16_TIE_EPSILON)
    assert spec.stats.target_passes < len(spec.token_ids) / 2
