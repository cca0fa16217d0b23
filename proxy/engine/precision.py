"""The target model's numeric precision: its dtype, an fp32 output head, weight-only quantization.

Decoding reads every weight once per pass, so the bytes per weight set the speed of plain
decoding: fp32 is the slowest choice, bf16 halves the bytes, int8 and int4 weights halve them
again. What each choice promises (README, "What 'the same text' means"):

- ``float32``: the engine's text equals plain greedy decoding (``generate(do_sample=False)``)
  token for token, as it always has.
- ``bfloat16`` / ``float16`` / quantized weights: speculative text equals the plain decoding *of the
  same engine at the same precision*, except where the top two logits are within that
  precision's rounding (a batched verify rounds differently from a one-token pass).

``auto`` picks bf16 on CUDA, and on a CPU where oneDNN has native bf16 kernels (AVX512-BF16 or
AMX; measured on one: 15.7 against 9.9 tok/s plain, 147-196 against 50-55 with predictions,
docs/benchmarks.md); float32 elsewhere.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from foretell.proxy.options import DTYPE_CHOICES, QUANTIZE_CHOICES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# torchao's int4 kernels take groups of this many input features, and PyTorch's int8 kernel
# needs a multiple of 16 (on the CPU it crashes otherwise); layers whose width they do not
# divide stay unquantized.
INT4_GROUP_SIZE = 128
INT8_ALIGNMENT = 16


def cpu_has_native_bf16() -> bool:
    """Whether this CPU runs bf16 matrix products natively (oneDNN's own test)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        return False


def resolve_dtype(name: str | None, device: str | torch.device) -> torch.dtype:
    """The dtype named by ``--dtype`` (``auto`` or None: chosen for ``device``)."""
    if name in (None, "", "auto"):
        if torch.device(device).type == "cuda" or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}; got {name!r}")
    return DTYPES[name]


def default_fp32_head(dtype: torch.dtype, quantize: str = "none") -> bool:
    """The fp32 head is on by default over a bf16/fp16 body whose head can be rescored: an
    unquantized or int8 head, where a pass costs 1.01-1.10x (docs/benchmarks.md). An int4 head
    cannot (torchao packs its rows); keeping it unquantized instead costs a quarter of int4's
    plain speed here, so with int4 it is off unless asked for."""
    return dtype != torch.float32 and quantize in ("none", "int8")


def describe(dtype: torch.dtype, quantize: str = "none", fp32_head: bool = False) -> str:
    """A short label of a precision, as logs, /health and the calibration key show it:
    ``bfloat16``, ``bfloat16+fp32-head``, ``bfloat16/int4``."""
    label = str(dtype).removeprefix("torch.")
    if quantize != "none":
        label += f"/{quantize}"
    if fp32_head and dtype != torch.float32:
        label += "+fp32-head"
    return label


def import_torchao_quietly() -> None:
    """transformers imports torchao (when installed) with its quantizers. On import torchao
    warns about its CUDA-only kernels that a CPU build of torch cannot load, and (through
    torch's pytree logger, also later as transformers imports more of it) about enum
    registrations torch deprecated: harmless, and not for our users' terminals."""
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    torchao_log = logging.getLogger("torchao")
    level = torchao_log.level
    torchao_log.setLevel(logging.ERROR)
    try:
        import torchao  # noqa: F401
    except ImportError:
        pass
    finally:
        torchao_log.setLevel(level)


# ---- weight-only quantization --------------------------------------------------------------


class Int8WeightOnlyLinear(torch.nn.Module):
    """A linear layer with int8 weights (symmetric, one scale per output row), multiplied by
    PyTorch's own int8 weight-only kernel (``aten._weight_int8pack_mm``: CPU, CUDA, MPS).

    torchao's ``Int8WeightOnlyConfig`` converts the whole int8 weight back to the activation
    dtype on every call unless the model is compiled; measured here it decodes at 3.8 tok/s
    against bf16's 12.2, while this kernel reads the int8 bytes directly."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        if linear.in_features % INT8_ALIGNMENT:
            raise ValueError(f"int8 weight-only needs in_features divisible by {INT8_ALIGNMENT}, "
                             f"got {linear.in_features}")
        weight = linear.weight.detach().float()  # [out, in]
        scale = weight.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # [out]
        self.register_buffer("qweight", torch.round(weight / scale[:, None]).to(torch.int8))
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def float_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The de-quantized weight rows ``rows`` [c] in float32: [c, in]."""
        return self.qweight[rows].float() * self.scale[rows].float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.reshape(-1, x.shape[-1])  # [n, in]
        out = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scale.to(x.dtype))  # [n, out]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def _int4_config(device: torch.device):
    """torchao's int4 weight-only config for ``device`` (tinygemm kernels: CPU and CUDA)."""
    try:
        from torchao.quantization import Int4WeightOnlyConfig
    except ImportError as error:
        raise RuntimeError("--quantize int4 needs torchao: pip install torchao") from error
    if device.type == "cpu":  # the CPU's packed layout lives in torchao's prototype namespace
        from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig

        return PrototypeInt4WeightOnlyConfig(group_size=INT4_GROUP_SIZE)
    return Int4WeightOnlyConfig(group_size=INT4_GROUP_SIZE, int4_packing_format="tile_packed_to_4d")


def check_quantize(mode: str) -> None:
    if mode not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_CHOICES)}; got {mode!r}")


def quantize_weights(model, mode: str, fp32_head: bool = False) -> int:
    """Quantize the weights of ``model``'s linear layers in place, the output head included,
    except an int4 head when ``fp32_head`` asks to rescore it (only an unquantized or int8 head's
    rows can be read back). Returns how many layers were quantized. Embeddings stay as they are:
    a lookup reads one row per token, not the whole table."""
    check_quantize(mode)
    if mode == "none":
        return 0
    head = model.get_output_embeddings()
    keep_head = fp32_head and mode == "int4"
    if head is not None and head.weight is model.get_input_embeddings().weight and not keep_head:
        # A tied head is about to get weights of its own; the embedding keeps the original.
        model.config.tie_word_embeddings = False

    def wanted(module: torch.nn.Module) -> bool:
        if type(module) is not torch.nn.Linear or (keep_head and module is head):
            return False
        return module.in_features % (INT8_ALIGNMENT if mode == "int8" else INT4_GROUP_SIZE) == 0

    model.foretell_quantization = mode  # the engine reports it (SpeculativeEngine.precision)
    if mode == "int8":
        count = 0
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if wanted(child):
                    setattr(parent, name, Int8WeightOnlyLinear(child))
                    count += 1
        return count
    from torchao.quantization import quantize_

    device = next(model.parameters()).device
    count = sum(1 for module in model.modules() if wanted(module))
    quantize_(model, _int4_config(device), filter_fn=lambda module, _name: wanted(module))
    return count


# ---- the output head in fp32 -----------------------------------------------------------------

# A bf16 (fp16) product may differ from the fp32 product of the same inputs by its rounding, at
# most half a unit in the last place (2**-8 of the value for bf16, 2**-11 for fp16), and by the
# kernel's order of summation (fp32 accumulation: far less). This bound is twice the rounding,
# plus a floor for values near zero: too wide a bound only rescores a few more tokens (on real
# text ~1 a row).
_RELATIVE_ERROR = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}
_ABSOLUTE_ERROR = 1e-3
_RESCORE_CHUNK = 4096  # candidates scored at once where a flat row has thousands
_CANDIDATES = 4  # looked for with topk; a row with more is searched in full


def head_rows(head) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """For an output head whose weights can be read back (a plain linear layer, or int8), a
    function from row indices [c] to those weight rows in float32 [c, d]; else None."""
    if isinstance(head, Int8WeightOnlyLinear):
        return head.float_rows
    if type(head) is torch.nn.Linear and type(head.weight) is torch.nn.Parameter:
        return lambda rows: head.weight[rows].float()
    return None


def rescore_in_fp32(hidden: torch.Tensor, rows_of: Callable[[torch.Tensor], torch.Tensor],
                    bias: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor:
    """Float32 logits from a low-precision head: ``logits`` [n, V] (bf16/fp16, from ``hidden``
    [n, d] and the head's weights, whose rows ``rows_of`` gives in float32) upcast, and every
    token that could hold its row's largest logit scored again as a float32 product of the same
    inputs.

    The largest float32 product is then exact: if token j holds it, its low-precision logit is
    at least its exact value minus the error bound b, which is at least any other token's exact
    value minus b, hence at least the row's largest low-precision logit minus 2b; every token
    above that line is rescored. Greedy tokens follow float32 logits instead of bf16 ones, which
    round to 1/8 at |logit| ~ 20 and so tie at the top, where the first index would win. The
    other tokens keep their upcast low-precision logits (the tail of a sampled distribution)."""
    scores = logits.float()  # [n, V]
    best = scores.topk(_CANDIDATES, dim=-1)  # values, indices [n, 4]
    top = best.values[:, :1]  # [n, 1]
    line = top - 2 * (top.abs() * _RELATIVE_ERROR[logits.dtype] + _ABSOLUTE_ERROR)  # [n, 1]
    above = best.values >= line  # [n, 4]
    rows = torch.arange(scores.shape[0], device=scores.device)[:, None].expand_as(above)[above]  # [c]
    cols = best.indices[above]  # [c]
    crowded = above[:, -1].nonzero()[:, 0]  # rows with more candidates than topk returned
    if crowded.numel():  # rare: find them all (thousands in a flat row)
        more_rows, more_cols = torch.nonzero(scores[crowded] >= line[crowded], as_tuple=True)
        rows, cols = torch.cat([rows, crowded[more_rows]]), torch.cat([cols, more_cols])
    for start in range(0, rows.numel(), _RESCORE_CHUNK):
        r, c = rows[start:start + _RESCORE_CHUNK], cols[start:start + _RESCORE_CHUNK]
        exact = (hidden[r].float() * rows_of(c)).sum(dim=-1)  # [chunk]
        scores[r, c] = exact if bias is None else exact + bias[c].float()
    return scores
