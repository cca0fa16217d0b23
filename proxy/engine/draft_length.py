"""How much to draft: expected tokens per second from measured acceptance and pass cost.

A round that verifies ``k`` draft tokens with per-token acceptance ``a`` yields on average
``(1 - a**(k+1)) / (1 - a)`` tokens (the accepted prefix plus the target's own token) and costs
one target pass over ``k + 1`` positions. ``k = 0`` is plain decoding, so a source that keeps
missing is simply not used.

Under batching one pass serves every running sequence, so the draft lengths of a step are chosen
together (``choose_step_drafts``): they maximise the step's expected tokens over the cost of a
pass over all its positions. As the batch grows the fixed part of a pass is shared and each
drafted position's cost weighs more, so drafts shrink; a choice never falls below the rate of
the same step without drafts. The pass cost is fitted online from the passes actually run
(``OnlinePassCost``), the start-up measurement only a prior.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
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
        """One sequence's pass: the pending token plus ``draft_length`` drafts."""
        return self.at(draft_length + 1)

    def at(self, positions: int) -> float:
        """A pass over ``positions`` new positions in all."""
        return self.fixed + self.per_position * positions

    def __add__(self, other: "PassCostModel") -> "PassCostModel":
        return PassCostModel(self.fixed + other.fixed, self.per_position + other.per_position)

    @classmethod
    def measure(cls, forward_positions, positions=(1, 17, 65), repeats: int = 3,
                clock=time.perf_counter) -> "PassCostModel":
        """Time ``forward_positions(n)`` (one pass over n new positions) and fit a line.

        Takes the median of ``repeats`` runs per size after one warm-up; a least-squares line
        through the medians. Guarded so a noisy measurement can never give a negative slope.
        """
        forward_positions(positions[0])  # warm-up: allocator, kernels, caches
        medians = []
        for n in positions:
            times = []
            for _ in range(repeats):
                started = clock()
                forward_positions(n)
                times.append(clock() - started)
            times.sort()
            medians.append(times[len(times) // 2])
        return fit_line(list(positions), medians)


def fit_line(positions: list[float], times: list[float], weights: list[float] | None = None) -> PassCostModel:
    """Weighted least-squares line ``t = fixed + per_position * n``, guarded so that noise can
    never give a negative slope or a fixed part below one position's cost."""
    weights = weights or [1.0] * len(positions)
    total = sum(weights)
    mean_n = sum(w * n for w, n in zip(weights, positions)) / total
    mean_t = sum(w * t for w, t in zip(weights, times)) / total
    var_n = sum(w * (n - mean_n) ** 2 for w, n in zip(weights, positions))
    slope = sum(w * (n - mean_n) * (t - mean_t) for w, n, t in zip(weights, positions, times)) / var_n
    slope = max(slope, 1e-9)
    fixed = max(mean_t - slope * mean_n, slope)
    return PassCostModel(fixed=fixed, per_position=slope)


class OnlinePassCost:
    """The pass cost fitted from the passes actually run, robust to outliers.

    Passes are bucketed by their number of positions (powers of two); each bucket keeps its
    last ``window`` timings and counts by their medians, so a pass slowed by other load moves
    nothing. With two or more buckets observed, the line is fitted through the bucket medians
    alone; with one, the prior line is rescaled to it; with none, the prior (the start-up
    measurement, or the reference machine's default) stands.
    """

    def __init__(self, prior: PassCostModel, window: int = 32):
        self.prior = prior
        self.window = window
        self.buckets: dict[int, deque] = {}
        self._current = prior

    def observe(self, positions: int, seconds: float) -> None:
        if positions < 1 or not seconds > 0:
            return
        bucket = self.buckets.setdefault(positions.bit_length(), deque(maxlen=self.window))
        bucket.append((positions, seconds))
        self._current = None

    def reset(self, prior: PassCostModel) -> None:
        self.prior, self.buckets, self._current = prior, {}, prior

    @property
    def model(self) -> PassCostModel:
        if self._current is None:
            self._current = self._fit()
        return self._current

    def _fit(self) -> PassCostModel:
        points = [(statistics.median(n for n, _ in b), statistics.median(t for _, t in b), len(b))
                  for b in self.buckets.values() if b]
        if not points:
            return self.prior
        if len(points) == 1:
            n, t, _ = points[0]
            scale = t / self.prior.at(n)
            return PassCostModel(self.prior.fixed * scale, self.prior.per_position * scale)
        return fit_line([p[0] for p in points], [p[1] for p in points], [math.sqrt(p[2]) for p in points])


# Measured on the reference CPU machine for Gemma 3 270M in fp32 (benchmarks/pass_cost.py; the
# figures are in docs/benchmarks.md): a default for when no measurement was taken.
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
        self.credit(matched, matched < compared)

    def credit(self, accepted: float, missed: bool) -> None:
        """Count ``accepted`` tokens the source foresaw and, if it then missed, one miss."""
        self.accepted = self.accepted * self.decay + accepted
        self.rejected = self.rejected * self.decay + (1 if missed else 0)


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
    for length in candidate_lengths(available):
        rate = expected_yield(acceptance, run, length) / cost.cost(length)
        if rate > best_rate:
            best_length, best_rate = length, rate
    return best_length, best_rate


def candidate_lengths(available: int) -> list[int]:
    return [n for n in CANDIDATE_LENGTHS if n < available] + ([available] if available > 0 else [])


def expected_yield(acceptance: float, run: float | None, length: int) -> float:
    """Mean tokens of a round drafting ``length`` tokens. A source's agreement run is evidence
    of long copies, its measured acceptance of how often it misses: the more cautious counts,
    so a source that keeps re-anchoring on a false match and missing earns no long drafts."""
    expected = expected_tokens(acceptance, length)
    if run is not None:
        expected = min(expected, expected_tokens_after_run(run, length))
    return expected


@dataclass(frozen=True)
class DraftOption:
    """What one source offers one request this round."""

    source: str
    acceptance: float
    run: float | None
    available: int  # tokens it can propose
    calibration: float = 1.0  # realised over expected yield of its weighed drafts so far
    # A source that drafts with passes of its own (the draft model): their cost, one pass per
    # drafted position, shared by every request drafting from it in the step; None: free.
    pass_cost: PassCostModel | None = None

    def expected(self, length: int) -> float:
        """Mean tokens of a round drafting ``length`` of its tokens (1: plain decoding)."""
        return 1.0 if length == 0 else self.calibration * expected_yield(self.acceptance, self.run, length)


def choose_step_drafts(options: list[list[DraftOption]], fixed_positions: int, cost: PassCostModel,
                       extra_costs: list[PassCostModel | None] | None = None,
                       max_positions: int | None = None) -> list[tuple[str | None, int]]:
    """Every verifying sequence's source and draft length for one batched pass.

    ``fixed_positions``: positions the pass holds anyway (each sequence's pending token,
    prefill chunks); the step costs one pass over them and every drafted position.
    """
    return choose_drafts(options, lambda drafted: cost.at(fixed_positions + drafted), extra_costs,
                         None if max_positions is None else max_positions - fixed_positions)


def choose_drafts(options: list[list[DraftOption]], step_cost, extra_costs: list[PassCostModel | None] | None = None,
                  max_drafted: int | None = None, sweeps: int = 3) -> list[tuple[str | None, int]]:
    """Choose every request's source and draft length for one verification step: the one
    policy of every verifier, each with its own cost.

    ``options[i]``: the sources request i may draft from; ``step_cost(drafted)``: what the step
    costs with ``drafted`` draft positions in all (the engine: one batched pass; an upstream:
    an echo request, or a plain token for none); ``extra_costs[i]``: a per-request cost on top
    (the sampling verify), or None. A source with a ``pass_cost`` (the draft model) adds its own
    passes: as many as the longest draft taken from it, each over the requests still drafting
    (``DraftPasses``). Maximises the step's expected tokens per unit of cost by coordinate ascent
    from "no drafts", so the result is never worse than plain decoding of the same requests by
    the verifier's own estimate.
    """
    count = len(options)
    extra_costs = extra_costs or [None] * count
    chosen: list[tuple[DraftOption | None, int]] = [(None, 0)] * count
    passes = DraftPasses() if any(o.pass_cost is not None for opts in options for o in opts) else None

    def extra(i: int, length: int) -> float:
        return extra_costs[i].cost(length) if extra_costs[i] is not None else 0.0

    def yield_of(option: DraftOption | None, length: int) -> float:
        return 1.0 if option is None else option.expected(length)

    tokens = float(count)
    drafted = 0
    extras = sum(extra(i, 0) for i in range(count))
    for _ in range(sweeps):
        changed = False
        for i in range(count):
            option, length = chosen[i]
            base_tokens = tokens - yield_of(option, length)
            base_drafted = drafted - length
            base_extras = extras - extra(i, length)
            if passes is not None:
                passes.leave_out(chosen, i)
            best = (option, length)
            best_rate = tokens / (step_cost(drafted) + extras + (passes.cost(option, length) if passes else 0.0))
            for candidate in options[i]:
                for n in candidate_lengths(candidate.available):
                    if max_drafted is not None and base_drafted + n > max_drafted:
                        break
                    cost = step_cost(base_drafted + n) + base_extras + extra(i, n)
                    if passes is not None:
                        cost += passes.cost(candidate, n)
                    rate = (base_tokens + yield_of(candidate, n)) / cost
                    if rate > best_rate * (1 + 1e-9):
                        best, best_rate = (candidate, n), rate
            if best != chosen[i]:
                changed = True
                chosen[i] = best
                tokens = base_tokens + yield_of(*best)
                drafted = base_drafted + best[1]
                extras = base_extras + extra(i, best[1])
        if not changed:
            break
    return [(option.source, length) if option is not None and length > 0 else (None, 0)
            for option, length in chosen]


class DraftPasses:
    """The cost of the step's draft-model passes while one request's choice is varied: a source
    with a pass cost ``fixed + per_position * n`` runs one pass per drafted position, the j-th
    over the requests drafting at least j tokens from it, which sums to
    ``fixed * longest + per_position * total``."""

    def __init__(self):
        self.others: dict[str, tuple[PassCostModel, int, int]] = {}

    def leave_out(self, chosen: list[tuple[DraftOption | None, int]], index: int) -> None:
        """Every other request's draws on each costed source: (cost, longest, total)."""
        self.others = {}
        for j, (option, length) in enumerate(chosen):
            if j != index and option is not None and option.pass_cost is not None and length > 0:
                cost, longest, total = self.others.get(option.source, (option.pass_cost, 0, 0))
                self.others[option.source] = (cost, max(longest, length), total + length)

    def cost(self, option: DraftOption | None, length: int) -> float:
        """Every costed source's passes with this request drafting ``length`` from ``option``."""
        spans = dict(self.others)
        if option is not None and option.pass_cost is not None and length > 0:
            cost, longest, total = spans.get(option.source, (option.pass_cost, 0, 0))
            spans[option.source] = (cost, max(longest, length), total + length)
        return sum(c.fixed * longest + c.per_position * total for c, longest, total in spans.values())
