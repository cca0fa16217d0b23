"""The native row-invariant RMSNorm against its float64 reference and against the model families'
own norms, its row bits (a row alone, among 1..64 others, in a 3-d tensor), and which modules
the int8 precision replaces (a norm of another formula is left alone)."""

import copy

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from foretell.kernels.row_norm import native_module, rms_norm, rms_norm_reference
from foretell.proxy.engine.invariant_linear import fbgemm_available
from foretell.proxy.engine.invariant_norm import RowInvariantRMSNorm, use_row_invariant_norms
from foretell.proxy.engine.precision import quantize_weights

pytestmark = pytest.mark.skipif(native_module() is None, reason="no C++ compiler for the native loop")


def _rows(n, d, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=generator) * torch.rand(n, 1, generator=generator) * 8
    x[0, min(3, d - 1)] = 300.0  # an outlier channel, as Gemma's rows have
    return x, torch.randn(d, generator=generator)


@pytest.mark.parametrize("d", [640, 256, 1152, 37, 16, 1])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_matches_the_float64_reference(d, offset):
    x, weight = _rows(65, d, seed=d)
    out = rms_norm(x, weight, 1e-6, offset)
    assert out.dtype == torch.float32 and out.shape == x.shape
    reference = rms_norm_reference(x, weight, 1e-6, offset)
    torch.testing.assert_close(out.double(), reference, rtol=2e-6, atol=1e-6)


def test_the_epsilon_counts():
    x = torch.full((2, 64), 1e-3)
    weight = torch.zeros(64)
    for eps in (1e-6, 1e-2):
        torch.testing.assert_close(rms_norm(x, weight, eps, 1.0).double(), rms_norm_reference(x, weight, eps, 1.0))
    assert not torch.equal(rms_norm(x, weight, 1e-6, 1.0), rms_norm(x, weight, 1e-2, 1.0))


@pytest.mark.parametrize("d", [640, 256, 37])
def test_a_row_has_the_same_bits_alone_and_among_others(d):
    x, weight = _rows(64, d, seed=1)
    alone = torch.cat([rms_norm(x[i:i + 1], weight, 1e-6, 1.0) for i in range(64)])
    for n in range(1, 65):
        assert torch.equal(rms_norm(x[:n], weight, 1e-6, 1.0), alone[:n]), n
    # a row among others it has never met, and as the per-head norm's [rows, heads, d] input
    shuffled = torch.cat([x[40:], torch.randn(9, d), x[:40]])
    assert torch.equal(rms_norm(shuffled, weight, 1e-6, 1.0)[-40:], alone[:40])
    assert torch.equal(rms_norm(x.view(16, 4, d), weight, 1e-6, 1.0), alone.view(16, 4, d))


@pytest.mark.parametrize("family,offset", [(Gemma3RMSNorm, 1.0), (LlamaRMSNorm, 0.0)])
def test_replaces_each_family_norm_with_its_formula(family, offset):
    norm = family(640, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(generator=torch.Generator().manual_seed(2))
    model = torch.nn.Sequential(norm)
    x, _ = _rows(5, 640, seed=3)
    with torch.no_grad():
        theirs = model(x)
    assert use_row_invariant_norms(model) == 1
    replaced = model[0]
    assert isinstance(replaced, RowInvariantRMSNorm) and replaced.offset == offset
    assert replaced.weight is norm.weight and list(model.state_dict()) == ["0.weight"]
    with torch.inference_mode():
        torch.testing.assert_close(model(x), theirs, rtol=1e-5, atol=1e-5)


class OtherRMSNorm(torch.nn.Module):
    """Named like an RMSNorm, but a mean-centred formula: must be left as it is."""

    def __init__(self, d):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(d))
        self.eps = 1e-6

    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def test_leaves_other_norms_alone():
    bf16 = Gemma3RMSNorm(64).to(torch.bfloat16)
    model = torch.nn.Sequential(OtherRMSNorm(64), bf16, torch.nn.LayerNorm(64))
    assert use_row_invariant_norms(model) == 0
    assert isinstance(model[0], OtherRMSNorm) and model[1] is bf16


@pytest.mark.skipif(not fbgemm_available(), reason="int8 x int8 needs FBGEMM (x86 torch)")
def test_only_the_int8_precision_uses_them(tiny_model):
    """float32 keeps transformers' norms (generate(do_sample=False)'s bits); int8 takes every one."""
    assert not any(isinstance(m, RowInvariantRMSNorm) for m in tiny_model.modules())
    model = copy.deepcopy(tiny_model)
    norms = sum(type(m).__name__ == "Gemma3RMSNorm" for m in model.modules())
    quantize_weights(model, "int8")
    assert sum(isinstance(m, RowInvariantRMSNorm) for m in model.modules()) == norms > 0
    assert not any(type(m).__name__ == "Gemma3RMSNorm" for m in model.modules())


def test_bad_inputs_are_refused():
    x = torch.randn(3, 64)
    with pytest.raises(AssertionError, match="weight"):
        rms_norm(x, torch.ones(63), 1e-6, 1.0)
    with pytest.raises(AssertionError, match="float32"):
        rms_norm(x.to(torch.bfloat16), torch.ones(64, dtype=torch.bfloat16), 1e-6, 1.0)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        native_module().rms_norm(x.t(), torch.ones(3), 1e-6, 1.0)  # the loop's own check
