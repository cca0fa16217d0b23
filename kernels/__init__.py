"""foretell.kernels: Triton kernels for the verify step, each with a pure-torch reference.

The reference is both the CPU path and the test oracle for the kernel.
"""

from foretell.kernels.greedy_verify import (
    greedy_verify,
    greedy_verify_reference,
    greedy_verify_triton,
)
from foretell.kernels.rejection_sample import (
    rejection_sample,
    rejection_sample_reference,
    rejection_sample_triton,
)

__all__ = [
    "greedy_verify", "greedy_verify_reference", "greedy_verify_triton",
    "rejection_sample", "rejection_sample_reference", "rejection_sample_triton",
]
