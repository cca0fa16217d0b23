"""The native int8 row quantization and scaling against the torch operations they replace: the
same bits, row for row, at every row count (so the int8 layer's texts are unchanged by it)."""

import pytest
import torch

from foretell.proxy.engine.invariant_linear import (
    ACTIVATION_LEVEL,
    Int8DynamicLinear,
    fbgemm_available,
    native_int8_rows,
    quantize_rows,
)

pytestmark = [
    pytest.mark.skipif(native_int8_rows() is None,
                       reason="the native int8 rows are not built or not bit-equal to torch on this CPU"),
    pytest.mark.skipif(not fbgemm_available(), reason="int8 activations need FBGEMM"),
]


def _rows(n, width, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=generator) * torch.rand(n, 1, generator=generator) * 10
    x[0, 3] = 300.0  # an outlier channel, as Gemma's rows have
    if n > 2:
        x[1] = 0.0  # a zero row: the smallest scale
        x[2, :5] = -0.0
    return x


@pytest.mark.parametrize("width", [640, 2048, 64, 37])
@pytest.mark.parametrize("n", [1, 2, 3, 17, 65])
def test_quantization_gives_the_torch_operations_bits(width, n):
    x = _rows(n, width, seed=n * width)
    stacked, scales, residual = native_int8_rows().quantize_rows(x, 2, float(ACTIVATION_LEVEL))
    levels, reference_scales, reference_residual = quantize_rows(x, 2)
    assert torch.equal(stacked, torch.cat(levels))
    assert torch.equal(scales, torch.stack(reference_scales))
    assert torch.equal(residual, reference_residual)


@pytest.mark.parametrize("width", [16, 37, 641])
def test_the_largest_magnitude_is_found_in_every_lane_and_in_the_tail(width):
    """The row's largest |x| (which sets its scale) taken 16 lanes at a time, then the tail:
    wherever it sits and whatever its sign, the scales are torch's."""
    generator = torch.Generator().manual_seed(width)
    for place in sorted({0, 7, 15, width // 2, width - 1}):
        for sign in (1.0, -1.0):
            x = torch.randn(2, width, generator=generator)
            x[:, place] = 50.0 * sign
            x[1, (place + 1) % width] = -0.0
            _, scales, _ = native_int8_rows().quantize_rows(x, 2, float(ACTIVATION_LEVEL))
            _, reference_scales, _ = quantize_rows(x, 2)
            assert torch.equal(scales, torch.stack(reference_scales)), (place, sign)
            assert float(scales[0, 0, 0]) == pytest.approx(50.0 / ACTIVATION_LEVEL)  # it was the largest


@pytest.mark.parametrize("shape,bias", [((1536, 640), False), ((640, 2048), True), ((300, 64), True), ((29, 37), True)])
def test_the_layer_gives_the_torch_operations_bits(shape, bias):
    out_features, in_features = shape
    layer = Int8DynamicLinear(torch.nn.Linear(in_features, out_features, bias=bias), keep_float_rows=True)
    for n in (1, 4, 33):
        x = _rows(n, in_features, seed=n)
        native = layer.product(x)
        residual_norm = layer.last_residual_norm
        reference, reference_residual = layer.product_as_torch_operations(x)
        assert torch.equal(native, reference), f"{n} rows"
        assert torch.equal(residual_norm, reference_residual.norm(dim=-1, keepdim=True))


def test_bad_inputs_are_refused():
    native = native_int8_rows()
    with pytest.raises(RuntimeError, match="contiguous float32"):
        native.quantize_rows(torch.randn(3, 8).t(), 2, 63.0)
    with pytest.raises(RuntimeError, match="expected 6"):
        native.scale_rows(torch.randn(5, 4), torch.rand(2, 3, 1), torch.empty(0))
