"""How many times each Triton kernel wrapper launched, counted on the host.

The engine promises one attention launch per layer and at most one verify launch per kind per
step; tests read these counts around a step to check it. Counting is one dict update per
launch, nothing on the device.
"""

from collections import Counter

LAUNCHES: Counter = Counter()


def count_launch(name: str) -> None:
    """Record one launch of the kernel wrapper ``name``."""
    LAUNCHES[name] += 1
