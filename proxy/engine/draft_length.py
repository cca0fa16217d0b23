"""How much to draft: expected tokens per second from measured acceptance and pass cost.

A round that verifies ``k`` draft tokens with per-token acceptance ``a`` yields on average
``(1 - a**(k+1)) / (1 - a)`` tokens (the accepted prefix plus the target's own token) and costs
one target pass over ``k + 1`` positions. We pick the source and ``k`` that maximise
tokens / cost. ``k = 0`` is plain decoding, so a source that keeps missing is simply not used.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

# Draft lengths considered each round (plus the longest the source can offer).
CANDIDATE_LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass(frozen=True)
class PassCostModel:
    """Cost of one target pass over ``positions`` new positions: ``fixed + per_position * n``.

    Only the ratio matters for choosing ``k``, so the unit (seconds) is incidental.
    """

    fixed: float
    per_position: float

    def cost(self, draft_length: int) -> float:
        return self.fixed + self.per_position * (draft_length + 1)

    def __add__(self, other: "PassCostModel") -> "PassCostModel":
        return PassCostModel(self.fixed + other.fixed, self.per_position + other.per_position)

    @classmethod
    def measure(cls, forward_positions, positions=(1, 17, 65), repeats: int = 3) -> "PassCostModel":
        """Time ``forward_positions(n)`` (one pass over n new positions) and fit a line.

        Takes the median of ``repeats`` runs per size after one warm-up; a least-squares line
        through the medians. Guarded so a noisy measurement can never give a negative slope.
        """
        forward_positions(positions[0])  # warm-up: allocator, kernels, caches
        medians = []
        for n in positions:
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                forward_positions(n)
                times.append(time.perf_counter() - started)
            times.sort()
            medians.append(times[len(times) // 2])
        mean_n = sum(positions) / len(positions)
        mean_t = sum(medians) / len(medians)
        var_n = sum((n - mean_n) ** 2 for n in positions)
        slope = sum((n - mean_n) * (t - mean_t) for n, t in zip(positions, medians)) / var_n
        slope = max(slope, 1e-9)
        fixed = max(mean_t - slope * mean_n, slope)
        return cls(fixed=fixed, per_position=slope)


# Measured on the reference CPU machine for Gemma 3 270M (see design.md): a default for when no
# measurement was taken.
DEFAULT_PASS_COST = PassCostModel(fixed=0.068, per_position=0.004)
# The sampling verify's own cost on top of the pass (distributions over the 262k vocabulary,
# the draws, the kernel), measured the same way: it makes long drafts dearer when sampling.
DEFAULT_SAMPLING_COST = PassCostModel(fixed=0.008, per_position=0.0012)


class AcceptanceEstimate:
    """Per-token acceptance of one draft source, from decayed success / failure counts.

    Counts are observed every round for every source (also the ones not used that round: what
    they would have proposed is compared with what the target produced, at no cost), so a
    source that starts matching again is noticed without spending a pass on it.
    """

    def __init__(self, prior_accepted: float = 4.0, prior_rejected: float = 1.0, decay: float = 0.9):
        self.accepted = prior_accepted
        self.rejected = prior_rejected
        self.decay = decay

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def update(self, proposal: list[int], produced: list[int]) -> None:
        """Score a proposal against the tokens the target produced after the same point."""
        if not proposal or not produced:
            return
        compared = min(len(proposal), len(produced))
        matched = 0
        while matched < compared and proposal[matched] == produced[matched]:
            matched += 1
        self.accepted = self.accepted * self.decay + matched
        self.rejected = self.rejected * self.decay + (1 if matched < compared else 0)


def expected_tokens(acceptance: float, draft_length: int) -> float:
    """Mean tokens one round yields: accepted drafts plus the target's own token."""
    if acceptance >= 1.0:
        return draft_length + 1.0
    return (1.0 - acceptance ** (draft_length + 1)) / (1.0 - acceptance)


def expected_tokens_after_run(run: float, draft_length: int) -> float:
    """Mean tokens one round yields when the source has agreed with the output for ``run``
    tokens in a row. Copies break at edits, not at random, so runs are long-tailed: a run that
    has lasted n tokens outlives n + i with probability about n / (n + i)."""
    if run <= 0:
        return 1.0
    return 1.0 + run * math.log1p(draft_length / run)


def best_draft_length(acceptance: float, available: int, cost: PassCostModel,
                      run: float | None = None) -> tuple[int, float]:
    """The draft length (0..available) with the highest expected tokens per unit of cost.

    ``acceptance`` is the source's running per-token estimate; ``run``, when the source tracks
    one, its current agreement run. With both, the more cautious expectation counts.
    """
    best_length, best_rate = 0, 1.0 / cost.cost(0)
    lengths = [n for n in CANDIDATE_LENGTHS if n < available] + ([available] if available > 0 else [])
    for length in lengths:
        expected = expected_tokens(acceptance, length)
        if run is not None:
            expected = expected_tokens_after_run(run, length)
        rate = expected / cost.cost(length)
        if rate > best_rate:
            best_length, best_rate = length, rate
    return best_length, best_rate
