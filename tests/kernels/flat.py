"""Helpers of the verify kernels' tests: the device they run on and the flat layout
(``foretell.kernels.flat_layout``) taken apart per sequence."""

import os

import torch

# cpu: the kernels run under Triton's interpreter; cuda: compiled (benchmarks/gpu_check.py).
DEVICE = torch.device(os.environ.get("FORETELL_TEST_DEVICE", "cpu"))


def dev(*tensors):
    out = tuple(t.to(DEVICE) for t in tensors)
    return out if len(out) > 1 else out[0]


def cu_of(ks):
    """Inclusive cumsum of the per-sequence draft counts, int64, on DEVICE."""
    return dev(torch.tensor(list(ks), dtype=torch.int64).cumsum(0))


def spans(cu):
    """Per sequence: (draft_start, k, row_start), from an inclusive cumsum."""
    out, prev = [], 0
    for b, c in enumerate(cu.tolist()):
        out.append((prev, c - prev, prev + b))
        prev = c
    return out


def split(output_tokens, cu):
    """Flat output -> list of per-sequence lists."""
    out = output_tokens.tolist()
    return [out[r:r + k + 1] for _, k, r in spans(cu)]
