"""bf16 linear layers whose every output row has the same bits, whatever else shares the pass.

Why: on a CPU with native bf16 (AVX512-BF16, AMX) oneDNN's bf16 product is the fastest kernel
from a few rows up (on an AMX Xeon the 262144 x 640 head takes about as long at 32 rows as at
one), which is what a verify pass needs. But it is not batch invariant: the kernel it runs
depends on the row count, and so do the bits. Measured on that Xeon (2 threads, the embedded
model's own weights): every row count from 1 to 32 gives a row the bits it has alone, wherever it
sits in the call and whatever the other rows hold; from 33 rows on, ``o_proj`` (640 x 1024),
``gate``/``up``-shaped products (2048 x 640) and the head round otherwise. So a pass of k + 1
draft rows could give a row other bits than k + 1 one-row passes would, and at a near tie
speculation could change the text (4 of 6 edit prompts equal to plain, ``benchmarks/
bf16_invariance_probe.py``).

Here each bf16 ``nn.Linear`` multiplies in calls of at most ``rows`` rows, ``rows`` the largest
of ``ROW_CANDIDATES`` for which every count up to it gave one-row bits in a check run when the
model loads, on the model's own weights (``largest_alike_rows``). A one-row decoding pass makes
one call as before; a verify pass of up to ``rows`` rows too; only long prefills make more calls.
Where one row has a kernel of its own (on a Zen 4 EPYC with AVX512-BF16 and no AMX, a 2048-wide
one-row product summed otherwise than every count from 2 to 32, which agree), calls of one row
are padded to two (``least``), and a decoding pass pays a two-row product.
With the attention's fixed key split (``invariant_attention.py``) and the head decided by
rescoring in float32 (``precision.rescore_in_fp32``), a row's bits then do not depend on the pass
it is in, and speculative text equals plain text at bf16.

The check is what makes this a property of the CPU the engine runs on, not of the one it was
measured on: where no candidate passes (another kernel library, another CPU), the layers stay as
they are and the engine reports ``batch_invariant`` false.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("foretell.engine")

ROW_CANDIDATES = (32, 16, 8, 4)  # rows per call, largest first: fewer calls for a long prefill
LEAST_ROWS = (1, 2)  # rows a call is padded to: none, else two (a one-row kernel of its own)


class RowChunkedLinear(torch.nn.Linear):
    """``linear`` (its own weight and bias tensors, so a tied head stays tied) multiplied in
    calls of at most ``rows`` rows and at least ``least`` (a shorter call padded with zero rows)."""

    def __init__(self, linear: torch.nn.Linear, rows: int, least: int = 1):
        torch.nn.Module.__init__(self)  # not Linear's: it would allocate a new weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.rows, self.least = rows, least

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rows={self.rows}, least={self.least}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        flat = x.reshape(-1, x.shape[-1])  # [n, in]
        n = flat.shape[0]
        if n < self.least:
            out = padded_product(flat, self.weight, self.bias, self.least)
        elif n <= self.rows:
            out = product(flat, self.weight, self.bias)
        else:  # each call writes its rows of one output: no concatenation
            out = flat.new_empty(n, self.out_features)
            for start in range(0, n, self.rows):
                stop = min(n, start + self.rows)
                if stop - start < self.least:
                    out[start:stop] = padded_product(flat[start:stop], self.weight, self.bias, self.least)
                else:
                    product(flat[start:stop], self.weight, self.bias, out=out[start:stop])
        return out.reshape(*x.shape[:-1], self.out_features)


def product(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """rows [n, in] x weight [out, in] (+ bias) -> [n, out], the one product both the layer and
    the check run (``F.linear``'s own kernels: mm, or addmm with a bias). Inference only: ``out=``
    takes no autograd, so the weights are read detached."""
    if bias is None:
        return torch.mm(rows, weight.detach().t(), out=out)
    return torch.addmm(bias.detach(), rows, weight.detach().t(), out=out)


def padded_product(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, least: int) -> torch.Tensor:
    """``product`` of rows [n, in], n < least, in a call of ``least`` rows (zero rows after them)."""
    padded = rows.new_zeros(least, rows.shape[1])
    padded[:rows.shape[0]] = rows
    return product(padded, weight, bias)[:rows.shape[0]]


def first_count_unlike(weight: torch.Tensor, bias: torch.Tensor | None, most: int, least: int = 1,
                       seed: int = 0) -> int | None:
    """The smallest row count n in 2..``most`` (from ``least`` where it is over 1) at which some
    row of an n-row product does not have the bits it has in a ``least``-row call (alone, padded
    with zero rows); None if every count gives them. At each count, all the probe rows in calls
    of n, each row of each call compared: after rounding to bf16 another summation order
    shows in few rows (on a Zen 4, one 2048-wide row in eight differed between a one-row and a
    two-row call), so one probe row is not enough."""
    generator = torch.Generator().manual_seed(seed)
    probes = torch.randn(most, weight.shape[1], generator=generator)
    probes[:, 3] *= 30  # an outlier channel, as real hidden states have
    probes = probes.to(weight.dtype)
    with torch.inference_mode():
        reference = torch.cat([padded_product(probes[i:i + 1], weight, bias, least) for i in range(most)])
        for n in range(max(2, least), most + 1):
            order = torch.roll(torch.arange(most), n)  # other neighbours and places at each count
            for start in range(0, most - n + 1, n):  # every probe row in calls of n (a few left out)
                rows = order[start:start + n]
                if not torch.equal(product(probes[rows], weight, bias), reference[rows]):
                    return n
    return None


def _largest_rows(linears: list[torch.nn.Linear], least: int) -> int | None:
    best = ROW_CANDIDATES[0]
    checked: set[tuple] = set()
    for linear in linears:
        shape = (tuple(linear.weight.shape), linear.bias is not None)
        if shape in checked:
            continue
        checked.add(shape)
        unlike = first_count_unlike(linear.weight.detach(), linear.bias, best, least)
        if unlike is not None:
            fitting = [rows for rows in ROW_CANDIDATES if least < rows < unlike]
            if not fitting:
                return None
            best = fitting[0]
    return best


def largest_alike_rows(linears: list[torch.nn.Linear]) -> tuple[int, int] | None:
    """(rows, least): the largest of ``ROW_CANDIDATES`` at which every count up to it gives a row
    the bits of a ``least``-row call on each distinct weight shape of ``linears`` (checked on one
    layer of each shape), with ``least`` 1 where it can be (no padding), else 2; or None."""
    for least in LEAST_ROWS:
        rows = _largest_rows(linears, least)
        if rows is not None:
            return rows, least
    log.warning("bf16 products round a row otherwise by the rows beside it: bf16 stays batch variant on this CPU")
    return None


def chunk_linear_rows(model) -> int | None:
    """Make every bf16 ``nn.Linear`` of ``model`` (its head too) a ``RowChunkedLinear`` of the
    checked row count, and mark the model batch invariant (``foretell_batch_invariant``, which
    also turns on the attention's fixed key split). Returns the row count, or None where the
    check found none (the model is left as it was)."""
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.dtype == torch.bfloat16]
    if not linears:
        return None
    plan = largest_alike_rows(linears)
    if plan is None:
        return None
    rows, least = plan
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and child.weight.dtype == torch.bfloat16:
                setattr(parent, name, RowChunkedLinear(child, rows, least))
    model.foretell_batch_invariant = True
    log.info("bf16 products in calls of %d to %d rows: every row count in it rounds a row alike here", least, rows)
    return rows
