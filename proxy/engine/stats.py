"""A request's figures: tokens, passes, drafts per source and position, seconds. The engine's and
the remote verifier's alike (``speculation.py`` keeps them), shown as the API's ``speculation``
field and in the metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SourceStats:
    rounds: int = 0  # rounds in which this source's draft was verified
    drafted: int = 0
    accepted: int = 0


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    completion_tokens: int = 0
    target_passes: int = 0  # passes that verified this sequence (after its prefill)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    per_source: dict[str, SourceStats] = field(default_factory=dict)
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    # Draft tokens verified / accepted at each position of a draft (vLLM's per-position view).
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0  # admission to the first verified token
    decode_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    def count_positions(self, drafted: int, accepted: int) -> None:
        for counts, n in ((self.drafted_by_position, drafted), (self.accepted_by_position, accepted)):
            if n > len(counts):
                counts.extend([0] * (n - len(counts)))
            for position in range(n):
                counts[position] += 1

    def speculation_report(self) -> dict:
        """The per-request speculation figures, as the API's ``speculation`` field shows them."""
        return {
            "target_passes": self.target_passes,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "per_source": {name: vars(s).copy() for name, s in self.per_source.items()},
            "decode_seconds": round(self.decode_seconds, 4),
        }

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            **self.speculation_report(),
            "accepted_prediction_tokens": self.accepted_prediction_tokens,
            "rejected_prediction_tokens": self.rejected_prediction_tokens,
            "prefill_seconds": round(self.prefill_seconds, 4),
            "tokens_per_second": round(self.tokens_per_second, 2),
        }
