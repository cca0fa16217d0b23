"""foretell.kernels: Triton kernels for the engine's step, each with a pure-torch reference.

- ``paged_attention``: every sequence of a step attends over its paged KV cache in one launch;
- ``greedy_verify`` and ``rejection_sample``: every sequence's draft verified in one launch;
- ``row_attention`` and ``int8_rows.cpp``: native CPU loops (C++, built on the user's machine by
  ``cpu_native``) for the batch-invariant attention and the int8 layer's row quantization,
  imported by the engine, not re-exported here.

The reference is both the CPU path and the test oracle for the kernel; ``launches`` counts the
Triton launches (tests check one per layer, one per kind of verify).
"""

from foretell.kernels.greedy_verify import (
    greedy_verify,
    greedy_verify_reference,
    greedy_verify_triton,
)
from foretell.kernels.launches import LAUNCHES
from foretell.kernels.paged_attention import (
    query_tiles,
    ragged_paged_attention_reference,
    ragged_paged_attention_triton,
)
from foretell.kernels.rejection_sample import (
    rejection_sample,
    rejection_sample_reference,
    rejection_sample_triton,
)

__all__ = [
    "LAUNCHES",
    "greedy_verify", "greedy_verify_reference", "greedy_verify_triton",
    "query_tiles", "ragged_paged_attention_reference", "ragged_paged_attention_triton",
    "rejection_sample", "rejection_sample_reference", "rejection_sample_triton",
]
