"""The target model's numeric precision: its dtype, an fp32 output head, quantization.

Decoding reads every weight once per pass, so the bytes per weight set the speed of plain
decoding: fp32 is the slowest choice, bf16 halves the bytes, int8 and int4 weights halve them
again. What each choice promises (README, "What 'the same text' means"):

- ``float32``: the engine's text equals plain greedy decoding (``generate(do_sample=False)``)
  token for token, but at near ties.
- ``int8`` with FBGEMM (x86): int8 weights times int8 activations in exact integer sums
  (``invariant_linear.py``), the output head rescored in float32 within a proven bound, and the
  attention's reductions in a fixed order (``invariant_attention.py``): a row's bits do not
  depend on the pass it is in, so speculative text equals this precision's plain text exactly,
  whatever else runs or is cached.
- ``bfloat16`` on a CPU with native bf16 (AVX512-BF16, AMX): the same promise as int8's. Every
  product runs in calls of at most a row count checked at load on the model's own weights, up to
  which oneDNN rounds a row as it rounds it alone (``row_chunked_linear.py``), with the same
  attention and the head rescored in float32.
- ``bfloat16`` elsewhere (or where that check fails) / ``float16`` / int4 (and int8 without
  FBGEMM): speculative text equals the plain decoding *of the same engine at the same precision*,
  except where the top two logits are within that precision's rounding (a batched verify rounds
  differently from a one-token pass).

``--quantize auto`` (the default) is int8 on a CPU where FBGEMM's int8 kernel measures faster
than float32 on the model's output head (timed once per machine and cached), else none; ``--dtype
auto`` is then float32 for what stays in floating point, else bf16 on CUDA and on a CPU with native
bf16 (AVX512-BF16 or AMX), else float32.
"""

from __future__ import annotations

import functools
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
# Projections that read the same input in the decoder families served (Llama, Gemma, Qwen,
# Mistral, Phi-3 have them under these names).
SHARED_INPUT_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def cpu_has_native_bf16() -> bool:
    """Whether this CPU runs bf16 matrix products natively (oneDNN's own test)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        return False


def resolve_dtype(name: str | None, device: str | torch.device, quantize: str = "none") -> torch.dtype:
    """The dtype named by ``--dtype`` (``auto`` or None: chosen for ``device`` and the resolved
    ``quantize``: float32 beside int8 on a CPU, whose integer kernels take float32 rows)."""
    if name in (None, "", "auto"):
        if quantize == "int8" and torch.device(device).type == "cpu":
            return torch.float32
        if torch.device(device).type == "cuda" or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}; got {name!r}")
    return DTYPES[name]


def default_fp32_head(dtype: torch.dtype, quantize: str = "none") -> bool:
    """The fp32 head is on by default over an approximate head that can be rescored: an int8
    head, or an unquantized bf16/fp16 one, where a pass costs 1.01-1.10x (docs/benchmarks.md).
    An int4 head cannot (torchao packs its rows); keeping it unquantized instead costs a quarter
    of int4's plain speed here, so with int4 it is off unless asked for."""
    return quantize == "int8" or (dtype != torch.float32 and quantize == "none")


def describe(dtype: torch.dtype, quantize: str = "none", fp32_head: bool = False) -> str:
    """A short label of a precision, as logs, /health and the calibration key show it:
    ``bfloat16``, ``bfloat16+fp32-head``, ``bfloat16/int4``, ``float32/int8+fp32-head``."""
    label = str(dtype).removeprefix("torch.")
    if quantize != "none":
        label += f"/{quantize}"
    if fp32_head and (dtype != torch.float32 or quantize != "none"):
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


def resolve_quantize(mode: str | None, device: str | torch.device, head_shape: tuple[int, int]) -> str:
    """The quantization named by ``--quantize``; ``auto`` (or None): ``int8`` on a CPU where
    FBGEMM's int8 x int8 kernel measures faster than float32 on the output head's (out, in)
    product, the step's largest (``kernel_timing.py``: timed once per machine); ``none`` elsewhere."""
    from foretell.proxy.engine.invariant_linear import fbgemm_available
    from foretell.proxy.engine.kernel_timing import int8_beats_float32

    if mode not in (None, "", "auto"):
        check_quantize(mode)
        return mode
    if torch.device(device).type != "cpu" or not fbgemm_available():
        return "none"
    return "int8" if int8_beats_float32(*head_shape) else "none"


def quantize_weights(model, mode: str, fp32_head: bool = False) -> int:
    """Quantize the weights of ``model``'s linear layers in place, the output head included,
    except an int4 head when ``fp32_head`` asks to rescore it (only an unquantized or int8 head's
    rows can be read back). Returns how many layers were quantized. Embeddings stay as they are:
    a lookup reads one row per token, not the whole table."""
    check_quantize(mode)
    if mode in ("none", "auto"):  # auto is resolved before (resolve_quantize)
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
        from foretell.proxy.engine.invariant_linear import Int8DynamicLinear, fbgemm_available, share_inputs

        integer = fbgemm_available()  # int8 activations too (batch invariant); else weight-only
        count = 0
        for parent in list(model.modules()) if integer else []:
            for names in SHARED_INPUT_PROJECTIONS:  # one quantization of their common input
                if share_inputs(parent, names):
                    count += len(names)
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if integer and type(child) is torch.nn.Linear:
                    setattr(parent, name, Int8DynamicLinear(child, keep_float_rows=child is head))
                    count += 1
                elif wanted(child):
                    setattr(parent, name, Int8WeightOnlyLinear(child))
                    count += 1
        model.foretell_batch_invariant = integer
        if integer:  # its norms too as one native call each: invariant, not transformers' bits
            from foretell.proxy.engine.invariant_norm import use_row_invariant_norms

            use_row_invariant_norms(model)
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
_CANDIDATES = 64  # without the native search: looked for with topk, a row with more searched in
# full (64 halves the rescoring of a 65-row pass against 4)


def head_rows(head) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """For an output head whose weights can be read back (a plain linear layer, int8, or int8
    with int8 activations keeping its float rows), a function from row indices [c] to those
    weight rows in float32 [c, d]; else None."""
    from foretell.proxy.engine.invariant_linear import Int8DynamicLinear
    from foretell.proxy.engine.row_chunked_linear import RowChunkedLinear

    if isinstance(head, Int8WeightOnlyLinear):
        return head.float_rows
    if isinstance(head, Int8DynamicLinear) and head.float_weight is not None:
        return head.float_rows
    if type(head) in (torch.nn.Linear, RowChunkedLinear) and type(head.weight) is torch.nn.Parameter:
        return lambda rows: head.weight[rows].float()
    return None


class RoundingBound:
    """The error bound of a bf16/fp16 head: its rounding of values near the row's top,
    ``|top| * relative + absolute``, the same for every token that can come near the top."""

    def __init__(self, logits: torch.Tensor, top: torch.Tensor):
        self.per_row = top.abs() * _RELATIVE_ERROR[logits.dtype] + _ABSOLUTE_ERROR  # [n, 1]

    def largest(self) -> torch.Tensor:
        return self.per_row

    def at(self, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.per_row[rows, 0]


def rescore_in_fp32(hidden: torch.Tensor, rows_of: Callable[[torch.Tensor], torch.Tensor],
                    bias: torch.Tensor | None, logits: torch.Tensor, bound=None) -> torch.Tensor:
    """Float32 logits from an approximate head: ``logits`` [n, V] (bf16/fp16, or int8's float32
    approximation, from ``hidden`` [n, d] and the head's weights, whose rows ``rows_of`` gives in
    float32) upcast, and every token that could hold its row's largest float32 logit scored
    again as a float32 product of the same inputs (plus the bias).

    ``bound`` has ``largest()`` [n, 1] and ``at(rows, tokens)`` [c]: a proven bound E_j on
    |logits_j - float32 logit_j| (None: ``RoundingBound``, a bf16/fp16 head's rounding). If
    token j holds the largest float32 logit and t the largest approximate one, then
    logits_j >= f32_j - E_j >= f32_t - E_j >= logits_t - E_t - E_j: every token that meets
    ``logits_j + E_j >= logits_t - E_t`` is rescored (found among those above
    ``logits_t - E_t - max E``: by ``head_candidates.cpp`` on a CPU, one pass a row for its top
    and one for the tokens above that line, else topk and a search of the rows it does not
    cover), so the largest float32 product is exact. Greedy tokens then follow float32 products
    of the hidden state, not the head's rounding (bf16 rounds to 1/8 at |logit| ~ 20 and so ties
    at the top, where the first index would win). The other tokens keep their approximate logits
    (the tail of a sampled distribution). Float32 ``logits`` (a fresh product, as the int8
    head's) are rescored in place rather than copied: 1 MB a row."""
    scores = logits.float()  # [n, V]
    native = native_head_candidates() if scores.device.type == "cpu" and scores.is_contiguous() else None
    if native is not None:  # one pass a row for its top, one for the tokens above the line
        top, leader = native.row_tops(scores)  # [n, 1] each
    else:
        best = scores.topk(min(_CANDIDATES, scores.shape[-1]), dim=-1)  # values, indices [n, 64]
        top, leader = best.values[:, :1], best.indices[:, :1]  # [n, 1]
    bound = bound if bound is not None else RoundingBound(logits, top)
    rows_n = torch.arange(scores.shape[0], device=scores.device)
    floor = top - bound.at(rows_n, leader[:, 0])[:, None]  # [n, 1]: logits_t - E_t
    line = floor - bound.largest()  # [n, 1]
    if native is not None:
        rows, cols = native.at_or_above(scores, line[:, 0].float().contiguous())  # [c] each
    else:
        rows, cols = _above_the_line(scores, best, line, rows_n)
    keep = scores[rows, cols] + bound.at(rows, cols) >= floor[rows, 0]  # the exact test per token
    rows, cols = rows[keep], cols[keep]
    for start in range(0, rows.numel(), _RESCORE_CHUNK):
        r, c = rows[start:start + _RESCORE_CHUNK], cols[start:start + _RESCORE_CHUNK]
        exact = (hidden[r].float() * rows_of(c)).sum(dim=-1)  # [chunk]
        scores[r, c] = exact if bias is None else exact + bias[c].float()
    return scores


def _above_the_line(scores, best, line, rows_n) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (row, token) of ``scores`` [n, V] at or above its row's ``line`` [n, 1], as torch
    operations: from the topk ``best`` [n, 64] where a row has fewer, else a search of the row."""
    above = best.values >= line  # [n, 64]
    full = above[:, -1].clone()  # [n]: rows with more candidates than topk returned
    above &= ~full[:, None]  # those are searched in full below, not rescored twice
    rows = rows_n[:, None].expand_as(above)[above]  # [c]
    cols = best.indices[above]  # [c]
    crowded = full.nonzero()[:, 0]
    if crowded.numel():  # find them all (thousands in a flat row)
        more_rows, more_cols = torch.nonzero(scores[crowded] >= line[crowded], as_tuple=True)
        rows, cols = torch.cat([rows, crowded[more_rows]]), torch.cat([cols, more_cols])
    return rows, cols


@functools.lru_cache(maxsize=None)
def native_head_candidates():
    """The native search (``foretell/kernels/head_candidates.cpp``), or None where it cannot be built."""
    from foretell.kernels.cpu_native import load_native

    return load_native("head_candidates")
