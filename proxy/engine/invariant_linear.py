"""A linear layer whose every output row has the same bits whatever else shares the pass:
int8 weights times int8 activations, summed exactly in int32.

Why: on a CPU without native bf16 (AVX2 alone, as most laptops and many VMs), the float kernels
read 4 bytes a weight and PyTorch's int8 weight-only kernel (``aten._weight_int8pack_mm``) is
compute-bound; FBGEMM's int8 x int8 kernel reads 1 byte a weight and multiplies with the CPU's
integer dot products. Measured on an AVX2 EPYC (2 threads, docs/benchmarks.md): the
262144 x 640 output head of the embedded model takes 54 ms at one row in float32, 81 ms
weight-only int8, 10.8 ms here (``benchmarks/linear_kernels.py``; alike at 64 rows, where the
two activation levels make 128 rows of integer products).

Why it is *batch invariant*: each row is quantized with its own scale, and integer sums are exact
whatever order the kernel adds in, so a row's output bits never depend on how many rows share
the pass or what they hold. A verify pass of k + 1 rows computes exactly what k + 1 plain passes
would, and speculation cannot change the text.

How each row is quantized: symmetric, scale ``max|x| / 63``, and then its residual quantized
again the same way (two levels, ~13 bits: one level of 7 bits loses too much on rows with an
outlier channel, as Gemma's have). Both levels of every row go through one kernel call, as rows.
FBGEMM takes an activation tensor with one scale for the whole tensor (per-tensor, which would
tie rows together), so the rows are handed over already as small integers with scale 1 and
zero point 64: its quantization is then the identity (values 1..127). 7-bit activations keep
the AVX2 kernel's 16-bit pair sums from saturating (2 * 127 * 128 < 2**15), so the int32 sums
are exact.

``error_bound`` gives, per row and token, a proven bound on |this layer's output - the float32
product of the same input and the original weights|, which lets the output head rescore every
token that could be the float32 argmax (``precision.rescore_in_fp32``).
"""

from __future__ import annotations

import functools
import logging
import warnings
from pathlib import Path

import torch

# Activations are quantized to [-63, 63], handed to FBGEMM as uint8 around this zero point.
ACTIVATION_LEVEL = 63
_ZERO_POINT = 64
WEIGHT_LEVEL = 127
_UNIT_ROUNDOFF = 2.0 ** -24  # float32
_NO_BIAS = torch.empty(0)
log = logging.getLogger("foretell.engine")


def last_level_cache_bytes(folder: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """The size of the CPU's largest cache (Linux's sysfs for the first core), or None where it
    cannot be read."""
    sizes, units = [], {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}
    for index in folder.glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        number, unit = (text[:-1], units[text[-1]]) if text and text[-1] in units else (text, 1)
        if number.isdigit():
            sizes.append(int(number) * unit)
    return max(sizes, default=None)


def rows_per_call(out_features: int, levels: int, cache_bytes: int | None) -> int | None:
    """The most rows one FBGEMM call of this layer takes, None: all. Measured on a Zen 4
    (docs/benchmarks.md): FBGEMM's call costs ~1.6x a row more once its float32 output passes the
    last-level cache (32 MiB there; the 262144-token head: 24 integer rows 19.5 ms, 32 rows 31.8,
    64 rows 78 ms in one call against 46 ms in calls of 24; at half the width the step moved to
    twice the rows). So a wide layer's product is taken in calls whose integer sums and scaled
    rows (``levels + 1`` float32 rows of ``out_features`` a row) fill three quarters of it: the
    head's 32 rows in calls of 8 took 49-51 ms against 66-94 ms in one call. Every row's integer
    sums are exact and scaled alone, so the calls give the same bits as one."""
    if cache_bytes is None:
        return None
    return max(1, (3 * cache_bytes // 4) // (4 * out_features * (levels + 1)))


_CACHE_BYTES = last_level_cache_bytes()  # read once; None: every product in one call


def fbgemm_available() -> bool:
    """Whether this torch build has FBGEMM's int8 kernels (x86 builds do)."""
    return ("fbgemm" in torch.backends.quantized.supported_engines
            and hasattr(torch.ops.quantized, "linear_with_input_q_dq_qweight_dq_output_fp32"))


@functools.lru_cache(maxsize=None)
def native_int8_rows():
    """The native quantization and scaling (``foretell/kernels/int8_rows.cpp``, one call each), or
    None where it cannot be built or where, on this CPU, it does not give the bits the torch
    operations give (checked once on random rows: torch's kernels differ by CPU)."""
    from foretell.kernels.cpu_native import load_native

    native = load_native("int8_rows")
    if native is None or _same_bits_as_torch(native):
        return native
    log.warning("the native int8 row quantization rounds otherwise than torch on this CPU; not used")
    return None


def _same_bits_as_torch(native) -> bool:
    generator = torch.Generator().manual_seed(0)
    for rows, width in ((1, 640), (5, 37), (33, 2048)):
        x = torch.randn(rows, width, generator=generator) * 10
        x[0, 1] = 300.0
        stacked, scales, residual = native.quantize_rows(x, 2, float(ACTIVATION_LEVEL))
        levels, torch_scales, torch_residual = quantize_rows(x, 2)
        integer = torch.randint(-5000, 5000, (2 * rows, width), generator=generator).float()
        bias = torch.randn(width, generator=generator)
        torch_out = torch.addcmul(integer[:rows] * scales[0], integer[rows:], scales[1]) + bias
        if not (torch.equal(stacked, torch.cat(levels)) and torch.equal(scales, torch.stack(torch_scales))
                and torch.equal(residual, torch_residual)
                and torch.equal(native.scale_rows(integer, scales, bias), torch_out)):
            return False
    return True


def quantize_rows(x: torch.Tensor, levels: int = 2) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Each row of ``x`` [n, d] (float32) as a sum of ``levels`` integer-valued rows times their
    scales: x = sum_l q[l] * s[l] + residual. Returns (q [n, d] per level, s [n, 1] per level,
    residual [n, d])."""
    quantized, scales, residual = [], [], x
    for _ in range(levels):
        largest = torch.linalg.vector_norm(residual, ord=float("inf"), dim=-1, keepdim=True)  # [n, 1]
        scale = largest.clamp_(min=1e-30).mul_(1.0 / ACTIVATION_LEVEL)
        q = torch.div(residual, scale).round_()  # [n, d] in [-63, 63]
        quantized.append(q)
        scales.append(scale)
        residual = torch.addcmul(residual, q, scale, value=-1.0)
    return quantized, scales, residual


class Int8DynamicLinear(torch.nn.Module):
    """``linear`` with int8 weights (symmetric, one scale per output row) and int8 activations
    (two levels, one scale per row and level), multiplied by FBGEMM."""

    def __init__(self, linear: torch.nn.Linear, levels: int = 2, keep_float_rows: bool = False):
        """``keep_float_rows``: keep a reference to the original weight, whose rows the output
        head rescores in float32 (``float_rows``); a tied head's is the embedding's own tensor."""
        super().__init__()
        if not fbgemm_available():
            raise RuntimeError("int8 activations need FBGEMM (an x86 build of torch)")
        weight = linear.weight.detach().float()  # [out, in]
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / WEIGHT_LEVEL  # [out]
        qweight = torch.clamp(torch.round(weight / scale[:, None]), -WEIGHT_LEVEL, WEIGHT_LEVEL)
        with warnings.catch_warnings():  # quantized tensors are deprecated; FBGEMM still packs them
            warnings.simplefilter("ignore", UserWarning)
            packed_input = torch._make_per_channel_quantized_tensor(
                qweight.to(torch.int8), scale.double(), torch.zeros_like(scale, dtype=torch.long), 0)
        self.packed = torch.ops.quantized.linear_prepack(packed_input, None)
        self.float_weight = linear.weight.detach() if keep_float_rows else None
        self.levels = levels
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # For error_bound: per output row, the norms of the de-quantized weights, of what
        # quantization took from them, and of the original weights.
        dequantized = qweight * scale[:, None]
        self.register_buffer("dequantized_norm", dequantized.norm(dim=1), persistent=False)  # [out]
        self.register_buffer("weight_error_norm", (weight - dequantized).norm(dim=1), persistent=False)
        self.register_buffer("weight_norm", weight.norm(dim=1), persistent=False)
        # Their largest values, which every step's bound needs (reduced once, not per step).
        self.largest_norms = (float(self.dequantized_norm.max()), float(self.weight_error_norm.max()),
                              float(self.weight_norm.max()))
        self.last_residual_norm: torch.Tensor | None = None  # [n, 1] of the last forward
        self.rows_per_call = rows_per_call(self.out_features, levels, _CACHE_BYTES)
        native_int8_rows()  # built now, at load, rather than in the first pass

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, levels={self.levels}"

    def float_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The original weight rows ``rows`` [c] in float32: [c, in]."""
        return self.float_weight[rows].float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out] (x's dtype)
        out = self.product(x.reshape(-1, x.shape[-1]))
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """[n, in] -> [n, out] in float32, the residual's norm kept for ``error_bound``."""
        rows = rows.float()
        native = native_int8_rows()
        if native is not None:  # the same arithmetic as below, one call each side of FBGEMM's
            stacked, scales, residual = native.quantize_rows(rows.contiguous(), self.levels, float(ACTIVATION_LEVEL))
            bias = self.bias.float() if self.bias is not None else _NO_BIAS
            out = self._product_in_calls(native, stacked.view(self.levels, rows.shape[0], self.in_features),
                                         scales, bias)
        else:
            out, residual = self.product_as_torch_operations(rows)
        if self.float_weight is not None:  # the output head: its bound needs the residual
            self.last_residual_norm = residual.norm(dim=-1, keepdim=True)  # [n, 1]
        return out

    def _product_in_calls(self, native, levels: torch.Tensor, scales: torch.Tensor,
                          bias: torch.Tensor) -> torch.Tensor:
        """The product of rows quantized to ``levels`` [L, n, in] with ``scales`` [L, n, 1],
        ``rows_per_call`` rows an FBGEMM call (one call for them all where it is None or above n;
        the slices are then the whole tensors, no copies), each call's rows scaled into their
        place in the output [n, out]."""
        n = levels.shape[1]
        most = self.rows_per_call or max(n, 1)  # (a pass may want no rows at all)
        out = torch.empty(n, self.out_features)
        for start in range(0, n, most):
            part = slice(start, min(start + most, n))
            integer = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
                levels[:, part].reshape(-1, levels.shape[-1]), 1.0, _ZERO_POINT, self.packed)  # [L * c, out]
            native.scale_rows_into(integer, scales[:, part].contiguous(), bias, out[part])
        return out

    def product_as_torch_operations(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``product``'s arithmetic as torch operations: [n, in] -> ([n, out], residual [n, in])."""
        n = rows.shape[0]
        quantized, scales, residual = quantize_rows(rows, self.levels)
        integer = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            torch.cat(quantized), 1.0, _ZERO_POINT, self.packed)  # [levels * n, out]
        out = integer[:n] * scales[0]
        for level in range(1, self.levels):
            out = torch.addcmul(out, integer[level * n:(level + 1) * n], scales[level])
        if self.bias is not None:
            out = out + self.bias.float()
        return out, residual

    def error_bound(self, hidden: torch.Tensor, residual_norm: torch.Tensor) -> "ProductErrorBound":
        """The bound for outputs just computed from ``hidden`` [n, in] (``residual_norm`` [n, 1]:
        the norm of what the activation quantization left, ``last_residual_norm``)."""
        return ProductErrorBound(self, hidden.float().norm(dim=-1, keepdim=True), residual_norm)


class ProductErrorBound:
    """|output_j - fl32(w_j . x)| <= bound for row x, token j, where ``w_j`` is the original weight
    row and fl32 the float32 dot product the rescoring computes.

    With w = W + e_w (W the de-quantized row) and x = X + e_x (X what the activation levels
    hold): w . x = W . X + W . e_x + e_w . x, and W . X is what the kernel summed exactly. By
    Cauchy-Schwarz |W . e_x| <= |W| |e_x| and |e_w . x| <= |e_w| |x|. Rounding: the kernel's
    scaling (a few float32 products and sums: at most ``levels + 2`` roundings of values no larger
    than |W| |x|) and the rescored dot product itself (at most d roundings, each at most
    u * |w| |x|). Margins of 1% cover the float32 rounding of the norms themselves."""

    def __init__(self, layer: Int8DynamicLinear, hidden_norm: torch.Tensor, residual_norm: torch.Tensor):
        self.layer = layer
        self.hidden_norm = hidden_norm  # [n, 1]
        self.residual_norm = residual_norm  # [n, 1]
        self.rounding = (layer.in_features + layer.levels + 4) * _UNIT_ROUNDOFF

    def _bound(self, hidden_norm, residual_norm, dequantized, weight_error, weight):
        return 1.01 * (residual_norm * dequantized + hidden_norm * weight_error
                       + self.rounding * hidden_norm * (weight + dequantized)) + 1e-6

    def largest(self) -> torch.Tensor:
        """Per row [n, 1]: the bound's largest value over every token."""
        return self._bound(self.hidden_norm, self.residual_norm, *self.layer.largest_norms)

    def at(self, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The bound for (row, token) pairs [c]."""
        layer = self.layer
        return self._bound(self.hidden_norm[rows, 0], self.residual_norm[rows, 0],
                           layer.dequantized_norm[tokens], layer.weight_error_norm[tokens],
                           layer.weight_norm[tokens])


class SharedInputProjection(torch.nn.Module):
    """One of several projections of the same input (q, k and v; gate and up) served by a
    single integer product of their stacked weights: the input is quantized once, and each
    output row's bits are what its own layer would give (rows and columns are independent)."""

    def __init__(self, group: "_ProjectionGroup", index: int):
        super().__init__()
        self.group, self.index = group, index
        self.in_features, self.out_features = group.linear.in_features, group.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(x, self.index)


class _ProjectionGroup:
    def __init__(self, linears: list[torch.nn.Linear]):
        stacked = torch.nn.Linear(linears[0].in_features, sum(l.out_features for l in linears),
                                  bias=any(l.bias is not None for l in linears))
        with torch.no_grad():
            stacked.weight.copy_(torch.cat([l.weight.float() for l in linears]))
            if stacked.bias is not None:
                stacked.bias.copy_(torch.cat([l.bias.float() if l.bias is not None
                                              else torch.zeros(l.out_features) for l in linears]))
        self.linear = Int8DynamicLinear(stacked)
        self.sizes = [l.out_features for l in linears]
        self._input: torch.Tensor | None = None
        self._outputs: tuple[torch.Tensor, ...] = ()
        self._served: set[int] = set()

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if x is not self._input or index in self._served:  # a new input: one product for all
            self._outputs = self.linear(x).split(self.sizes, dim=-1)
            self._input, self._served = x, set()
        self._served.add(index)
        out = self._outputs[index]
        if len(self._served) == len(self.sizes):  # every projection served: let go of the input
            self._input, self._outputs = None, ()
        return out


def share_inputs(parent: torch.nn.Module, names: tuple[str, ...]) -> bool:
    """Replace ``parent``'s linear children ``names`` (all of one input width) by one shared
    integer product; False when they are not all there as plain linear layers."""
    linears = [getattr(parent, name, None) for name in names]
    if not all(type(l) is torch.nn.Linear for l in linears) or len({l.in_features for l in linears}) != 1:
        return False
    group = _ProjectionGroup(linears)
    for index, name in enumerate(names):
        setattr(parent, name, SharedInputProjection(group, index))
    return True
