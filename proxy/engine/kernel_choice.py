"""Which implementation runs each of the engine's kernels, chosen once when the engine starts.

Three kernels: ``paged_attention`` (one launch per layer over the whole step, instead of the
per-sequence loop in ``kv_cache.py``), ``greedy_verify`` and ``rejection_sample`` (each once per
step over every sequence of its kind). Each has a pure-torch reference beside it.

``FORETELL_KERNELS`` (or ``--kernels``) picks:
- ``auto`` (default): Triton on CUDA when Triton is installed, the references elsewhere;
- ``triton``: Triton everywhere; on a CPU only under ``TRITON_INTERPRET=1`` (slow: for tests);
- ``reference``: the torch references (the attention loop) everywhere.

A Triton kernel that was never compiled on this GPU may fail to compile, fail to launch or
compute something else. So each chosen Triton kernel first runs once on small random inputs of
the model's own shapes and dtype against its reference: on any error or mismatch the engine
logs one line naming the kernel and the error, and uses the reference for that kernel instead
(``Kernels.fallbacks``, shown by ``/health`` and the ``foretell_kernel_fallback`` gauge).
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from foretell.proxy.options import KERNEL_CHOICES

# The modules (the package re-exports functions of the same names).
greedy_module = importlib.import_module("foretell.kernels.greedy_verify")
rejection_module = importlib.import_module("foretell.kernels.rejection_sample")
attention_module = importlib.import_module("foretell.kernels.paged_attention")

KERNEL_NAMES = ("paged_attention", "greedy_verify", "rejection_sample")

log = logging.getLogger("foretell.kernels")


@dataclass(frozen=True)
class AttentionShape:
    """The model's attention, as the self-check must exercise it."""

    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    window: int | None  # the sliding layers' window (None: no sliding layers)


@dataclass
class Kernels:
    """The implementation of every kernel. ``paged_attention`` None means the per-sequence loop."""

    mode: str
    paged_attention: Callable | None
    greedy_verify: Callable
    rejection_sample: Callable
    fallbacks: dict[str, str] = field(default_factory=dict)  # kernel -> why the reference runs

    @property
    def triton(self) -> list[str]:
        """The kernels that run Triton."""
        chosen = {"paged_attention": self.paged_attention is not None,
                  "greedy_verify": self.greedy_verify is greedy_module.greedy_verify_triton,
                  "rejection_sample": self.rejection_sample is rejection_module.rejection_sample_triton}
        return [name for name in KERNEL_NAMES if chosen[name]]

    def describe(self) -> dict:
        """What ``/health`` shows."""
        return {"mode": self.mode, "triton": self.triton, "fallback": dict(self.fallbacks)}


REFERENCES = {
    "paged_attention": None,
    "greedy_verify": greedy_module.greedy_verify_reference,
    "rejection_sample": rejection_module.rejection_sample_reference,
}


def _tritons() -> dict[str, Callable]:
    # Read at call time, so that a test can replace a Triton entry point in its module.
    return {
        "paged_attention": attention_module.ragged_paged_attention_triton,
        "greedy_verify": greedy_module.greedy_verify_triton,
        "rejection_sample": rejection_module.rejection_sample_triton,
    }


def _interpreted() -> bool:
    return (attention_module._kernels_interpreted() and greedy_module._kernels_interpreted()
            and rejection_module._kernels_interpreted())


def kernel_mode(mode: str | None) -> str:
    """``mode``, else ``FORETELL_KERNELS``, else auto; checked."""
    mode = mode or os.environ.get("FORETELL_KERNELS") or "auto"
    if mode not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got {mode!r}")
    return mode


def resolve_mode(mode: str | None, device: torch.device) -> bool:
    """Whether Triton runs for ``mode`` (``kernel_mode``) on ``device``. Raises ValueError for a
    mode Triton cannot serve here."""
    mode = kernel_mode(mode)
    if mode == "reference":
        return False
    if mode == "auto":
        return device.type == "cuda" and attention_module.HAVE_TRITON
    if not attention_module.HAVE_TRITON:
        raise ValueError("kernels=triton needs the 'triton' package, which is not importable")
    if device.type == "cpu" and not _interpreted():
        raise ValueError("kernels=triton on a CPU runs Triton's interpreter: set TRITON_INTERPRET=1 "
                         "in the environment before starting (slow; meant for tests)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"kernels=triton supports CUDA (or a CPU under the interpreter), not {device.type}")
    return True


def choose_kernels(mode: str | None, device: torch.device, dtype: torch.dtype,
                   attention: AttentionShape) -> Kernels:
    """The engine's kernels for ``mode`` (None: ``FORETELL_KERNELS``, else auto), each Triton
    one checked against its reference first."""
    mode = kernel_mode(mode)
    use_triton = resolve_mode(mode, device)
    chosen = dict(REFERENCES)
    fallbacks = {}
    if use_triton:
        for name, kernel in _tritons().items():
            problem = self_check(name, kernel, device, dtype, attention)
            if problem is None:
                chosen[name] = kernel
            else:
                fallbacks[name] = problem
                log.warning("foretell: the Triton kernel %s failed its start-up check (%s); "
                            "using the torch reference for it", name, problem)
    return Kernels(mode, chosen["paged_attention"], chosen["greedy_verify"], chosen["rejection_sample"],
                   fallbacks)


def self_check(name: str, kernel: Callable, device: torch.device, dtype: torch.dtype,
               attention: AttentionShape) -> str | None:
    """Run ``kernel`` once on small random inputs against its reference: None when they agree,
    else what went wrong (the error, or the mismatch)."""
    generator = torch.Generator().manual_seed(0)
    try:
        if name == "paged_attention":
            return _check_attention(kernel, device, dtype, attention, generator)
        if name == "greedy_verify":
            return _check_greedy(kernel, device, generator)
        return _check_rejection(kernel, device, generator)
    except Exception as error:  # a compile or launch error: the reference serves instead
        return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"


def _check_attention(kernel, device, dtype, shape: AttentionShape, generator) -> str | None:
    """Two steps, so that both tile sizes the engine launches are compiled and checked: one
    mixing a prefill chunk after a cached block with 3 verify rows, one decoding two sequences;
    blocks handed out in a scrambled order. Each without a window, and on sliding models with a
    window short enough to cross (the window is a run-time argument: the same compiled kernel),
    the blocks wholly behind it released (-1) and their slots filled with NaN, as the cache does."""
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    bs = shape.block_size
    windows = [None] + ([min(shape.window, bs + 3)] if shape.window else [])
    for steps in ([(bs, 2 * bs + 1), (5 * bs, 3)], [(5 * bs, 1), (2 * bs + 3, 1)]):  # (cached, new)
        need = [-(-(cached + new) // bs) for cached, new in steps]
        order = torch.randperm(sum(need), generator=generator).tolist()
        tables = torch.full((len(steps), max(need)), -1, dtype=torch.int32)
        for b, count in enumerate(need):
            tables[b, :count] = torch.tensor([order.pop() for _ in range(count)], dtype=torch.int32)
        keys, values = (torch.randn(shape.kv_heads, sum(need) * bs, shape.head_dim, generator=generator)
                        .to(dtype=dtype) for _ in range(2))
        query = torch.randn(sum(new for _, new in steps), shape.heads, shape.head_dim,
                            generator=generator).to(device=device, dtype=dtype)
        starts = [0] + torch.tensor([new for _, new in steps]).cumsum(0).tolist()
        for window in windows:
            table, k, v = tables.clone(), keys.clone(), values.clone()
            for b, (cached, _) in enumerate(steps):
                behind = max(0, cached - window + 1) // bs if window else 0
                for block in table[b, :behind].tolist():
                    k[:, block * bs:(block + 1) * bs] = float("nan")
                    v[:, block * bs:(block + 1) * bs] = float("nan")
                table[b, :behind] = -1
            layout = dict(block_table=table.to(device),
                          query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
                          seq_lens=torch.tensor([c + n for c, n in steps], dtype=torch.int32, device=device),
                          block_size=bs, scale=shape.head_dim ** -0.5, window=window)
            k, v = k.to(device), v.to(device)
            got = kernel(query, k, v, **layout)
            want = attention_module.ragged_paged_attention_reference(query, k, v, **layout)
            error = (got.float() - want.float()).abs().max().item()
            if not error <= tolerance:  # NaN fails too
                return f"output differs from the reference by {error:.3g} (window {window})"
    return None


def _flat_drafts(generator, logits, counts, device):
    """Drafts that follow each row's argmax, one miss in the middle: [N], cu [B]."""
    drafts, row = [], 0
    for count in counts:
        choices = logits[row:row + count].argmax(dim=-1).tolist()
        if count > 2:
            choices[count // 2] = (choices[count // 2] + 1) % logits.shape[-1]
        drafts += choices
        row += count + 1
    cu = torch.tensor(counts).cumsum(0)
    return torch.tensor(drafts, dtype=torch.long, device=device), cu.to(device)


def _check_greedy(kernel, device, generator) -> str | None:
    counts = [0, 3, 6]
    logits = torch.randn(sum(counts) + len(counts), 5000, generator=generator).to(device)
    drafts, cu = _flat_drafts(generator, logits, counts, device)
    got = kernel(logits, drafts, cu)
    want = greedy_module.greedy_verify_reference(logits, drafts, cu)
    if all(torch.equal(g, w) for g, w in zip(got, want)):
        return None
    return f"accepted {got[0].tolist()} where the reference accepts {want[0].tolist()}, or other tokens"


def _check_rejection(kernel, device, generator) -> str | None:
    counts = [0, 3, 6]
    logits = torch.randn(sum(counts) + len(counts), 5000, generator=generator)
    probs = torch.softmax(logits * 3, dim=-1).to(device)
    drafts, cu = _flat_drafts(generator, probs, counts, device)
    uniform = torch.rand(sum(counts), generator=generator).to(device)
    noise = torch.empty(len(counts), logits.shape[-1]).exponential_(generator=generator).to(device)
    got = kernel(probs, drafts, cu, uniform, noise)
    want = rejection_module.rejection_sample_reference(probs, drafts, cu, uniform, noise)
    if all(torch.equal(g, w) for g, w in zip(got, want)):
        return None
    return f"accepted {got[0].tolist()} where the reference accepts {want[0].tolist()}, or other tokens"
