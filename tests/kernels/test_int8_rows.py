"""The native int8 row quantization and scaling against the torch operations they replace: the
same bits, row for row, at every row count (so the int8 layer's texts are unchanged by it)."""

import pytest
import torch

from foretell.proxy.engine.invariant_linear import (
    ACTIVATION_LEVEL,
    Int8DynamicLinear,
    fbgemm_available,
    last_level_cache_bytes,
    native_int8_rows,
    quantize_rows,
    rows_per_call,
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


@pytest.mark.parametrize("most", [1, 2, 5])
def test_a_product_taken_in_several_calls_gives_the_bits_of_one(most):
    """A wide layer's rows go to FBGEMM ``rows_per_call`` at a time, each call's rows scaled into
    their place: every row as the torch operations give it in one call, the last call short."""
    layer = Int8DynamicLinear(torch.nn.Linear(64, 300, bias=True), keep_float_rows=True)
    layer.rows_per_call = most
    for n in (1, most, most + 1, 7, 33):
        x = _rows(n, 64, seed=n + most)
        native = layer.product(x)
        residual_norm = layer.last_residual_norm
        reference, reference_residual = layer.product_as_torch_operations(x)
        assert torch.equal(native, reference), f"{n} rows, {most} a call"
        assert torch.equal(residual_norm, reference_residual.norm(dim=-1, keepdim=True))
    assert layer.product(torch.empty(0, 64)).shape == (0, 300)  # a pass that wants no rows


def test_rows_per_call_keeps_a_calls_output_within_three_quarters_of_the_cache():
    mib = 2 ** 20
    assert rows_per_call(262144, 2, 32 * mib) == 8  # 16 integer rows and 8 scaled ones of 1 MiB each
    assert rows_per_call(262144, 1, 32 * mib) == 12
    assert rows_per_call(4096, 2, 32 * mib) == 512  # a body layer: a whole prefill chunk at once
    assert rows_per_call(262144, 2, 2 * mib) == 1  # never none
    assert rows_per_call(262144, 2, None) is None  # cache unknown: one call, as before


def test_the_last_level_cache_is_read_from_sysfs(tmp_path):
    for index, size in (("index0", "48K"), ("index1", "32K"), ("index2", "1024K"), ("index3", "32768K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    (tmp_path / "index4").mkdir()  # a cache without a size file, and one that says nothing useful
    (tmp_path / "index5").mkdir()
    (tmp_path / "index5" / "size").write_text("unknown\n")
    assert last_level_cache_bytes(tmp_path) == 32 * 2 ** 20
    assert last_level_cache_bytes(tmp_path / "missing") is None


def test_bad_inputs_are_refused():
    native = native_int8_rows()
    with pytest.raises(RuntimeError, match="contiguous float32"):
        native.quantize_rows(torch.randn(3, 8).t(), 2, 63.0)
    with pytest.raises(RuntimeError, match="expected 6"):
        native.scale_rows(torch.randn(5, 4), torch.rand(2, 3, 1), torch.empty(0))
    with pytest.raises(RuntimeError, match="out must be a contiguous float32"):
        native.scale_rows_into(torch.randn(6, 4), torch.rand(2, 3, 1), torch.empty(0), torch.empty(3, 5))
    with pytest.raises(RuntimeError, match="out must be a contiguous float32"):
        native.scale_rows_into(torch.randn(6, 4), torch.rand(2, 3, 1), torch.empty(0), torch.empty(4, 3).t())
