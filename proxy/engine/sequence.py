"""One request in flight: everything the batched step needs to know about it, and what a round
does to it (accept tokens, stop, stream text, count).

A sequence's KV cache holds every token except the newest one, the *pending* token. Each step
feeds it ``[uncached prompt tokens] + [pending] + draft``; the logits of the last ``k + 1`` rows
verify the draft (see ``engine.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from foretell.proxy.engine.detokenizer import IncrementalDetokenizer, StopStringHold
from foretell.proxy.engine.draft_length import AcceptanceEstimate, DraftOption
from foretell.proxy.engine.draft_sources import PredictionSource, PromptLookupSource
from foretell.proxy.engine.kv_cache import SequenceBlocks
from foretell.proxy.engine.prediction_usage import prediction_token_usage
from foretell.proxy.engine.sampling import SpeculativeSampler


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int = 256
    prediction: str | None = None
    # Prompt lookup: None means "as the fallback when a prediction is given, else off".
    prompt_lookup: bool | None = None
    stop: tuple[str, ...] = ()
    # Token ids that end the output as EOS does (never part of the text): a chat template's
    # end-of-turn tokens. Added to the engine's own EOS ids.
    stop_token_ids: tuple[int, ...] = ()
    # Upper bound on tokens drafted per round; the chooser usually picks fewer.
    max_draft: int = 128
    # 0 means greedy; > 0 samples (temperature, then top_k, then top_p), speculation included.
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    # Log-probabilities of the emitted tokens (the model's raw distribution, before temperature
    # and filtering) with this many alternatives each; None: not computed.
    logprobs: int | None = None
    # Log-probabilities of the prompt's own tokens (OpenAI's legacy ``echo`` with ``logprobs``)
    # with this many alternatives; None: not computed. Such a request reuses the prefix cache only
    # as far as an earlier prompt's logprobs are known (``prompt_logprob_cache.py``): a cached
    # prefix has no logits.
    prompt_logprobs: int | None = None


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


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens at this position, best first


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop", "length", "cancelled" or "error" (the sequence failed in a step)
    stats: GenerationStats
    # Per output token: the draft source it was accepted from, or None for the target's own.
    token_origins: list[str | None] = field(default_factory=list)
    # Per output token when the request asked for logprobs, else None.
    logprobs: list[TokenLogprob] | None = None
    seed: int | None = None  # the seed a sampled request ran with (its own or a fresh one)
    # Per prompt token after the first, when the request asked for prompt logprobs, else None.
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass
class SequenceUpdate:
    """What one step did for one sequence: the tokens it verified and the text they released."""

    sequence: "Sequence"
    token_ids: list[int]
    text: str
    origins: list[str | None]
    logprobs: list[TokenLogprob] | None = None
    result: GenerationResult | None = None  # set once the sequence has finished
    error: Exception | None = None  # set when this sequence failed (the others go on)


class Sequence:
    """A request in flight."""

    def __init__(self, request: GenerationRequest, max_tokens: int, tokenizer, device,
                 eos_token_ids: frozenset[int], blocks: SequenceBlocks):
        self.request = request
        self.prompt = list(request.prompt_ids)
        self.max_tokens = max_tokens
        self.eos_token_ids = frozenset(eos_token_ids) | frozenset(request.stop_token_ids)
        self.blocks = blocks
        self.sources = []
        if request.prediction:
            self.sources.append(PredictionSource(tokenizer, request.prediction))
        use_lookup = request.prompt_lookup if request.prompt_lookup is not None else bool(request.prediction)
        if use_lookup:
            self.sources.append(PromptLookupSource(self.prompt))
        self.estimates = {s.name: AcceptanceEstimate() for s in self.sources}
        self.sampler = None
        if request.temperature > 0:
            self.sampler = SpeculativeSampler(request.temperature, request.top_k, request.top_p,
                                              request.seed, device)
        self.stats = GenerationStats(prompt_tokens=len(self.prompt))
        self.stats.per_source = {s.name: SourceStats() for s in self.sources}
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stop_hold = StopStringHold(request.stop)
        self.output: list[int] = []
        self.origins: list[str | None] = []
        self.logprobs: list[TokenLogprob] | None = [] if request.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprob] | None = (
            [] if request.prompt_logprobs is not None else None)
        self.pending = self.prompt[-1]
        self.streamed = 0  # characters of text already handed out
        self.finish_reason: str | None = None
        self.admitted_at = time.perf_counter()
        self.first_verify_at: float | None = None
        # Set by the engine for the step in progress.
        self.proposals: dict[str, list[int]] = {}
        self.draft_source: str | None = None
        self.draft: list[int] = []

    # ---- where the sequence is ----------------------------------------------------------

    @property
    def uncached_prompt(self) -> int:
        """Prompt tokens before the pending one whose K/V is not in the cache yet."""
        return max(0, len(self.prompt) - 1 - self.blocks.committed)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def room(self) -> int:
        return self.max_tokens - len(self.output)

    # ---- drafting ------------------------------------------------------------------------

    def draft_options(self) -> list[DraftOption]:
        """Ask every source for its proposal (kept for scoring) and describe what it offers."""
        limit = min(self.request.max_draft, self.room - 1)  # a round yields draft + 1 at most
        self.proposals = {s.name: s.propose(limit) for s in self.sources}
        return [DraftOption(s.name, self.estimates[s.name].rate, s.agreement_run(), len(self.proposals[s.name]))
                for s in self.sources]

    def set_draft(self, source: str | None, length: int) -> None:
        self.draft_source = source
        self.draft = self.proposals[source][:length] if source is not None else []

    # ---- a verified round ----------------------------------------------------------------

    def accept(self, accepted: int, new_tokens: list[int], logprobs: list[TokenLogprob] | None) -> SequenceUpdate:
        """Take a round's verified tokens up to where plain decoding would have stopped."""
        if self.first_verify_at is None:
            self.first_verify_at = time.perf_counter()
            self.stats.prefill_seconds = self.first_verify_at - self.admitted_at
        self.stats.target_passes += 1
        draft, source = self.draft, self.draft_source
        kept: list[int] = []
        for token in new_tokens:
            kept.append(token)
            self.stop_hold.feed(self.detokenizer.push([token]))
            if token in self.eos_token_ids or self.stop_hold.stop_at is not None:
                self.finish_reason = "stop"
            elif len(self.output) + len(kept) >= self.max_tokens:
                self.finish_reason = "length"
            if self.finished:
                break
        accepted = min(accepted, len(kept))  # drafts past a stop do not count
        if source is not None:
            record = self.stats.per_source[source]
            record.rounds += 1
            record.drafted += len(draft)
            record.accepted += accepted
            self.stats.drafted_tokens += len(draft)
            self.stats.accepted_tokens += accepted
            self.stats.count_positions(len(draft), accepted)
        for name, proposal in self.proposals.items():
            self.estimates[name].update(proposal, kept)
        if logprobs is not None:
            logprobs = logprobs[: len(kept)]
            self.logprobs.extend(logprobs)
        origins = [source] * accepted + [None] * (len(kept) - accepted)
        self.output.extend(kept)
        self.origins.extend(origins)
        self.pending = kept[-1]
        for s in self.sources:
            s.observe(self.output, self.detokenizer.text)
        result = self.finish() if self.finished else None  # flushes the last characters first
        return SequenceUpdate(self, kept, self._release_text(), origins, logprobs, result=result)

    def _release_text(self) -> str:
        end = self.stop_hold.releasable if not self.finished else len(self.stop_hold.text)
        piece = self.stop_hold.text[self.streamed:end]
        self.streamed = max(self.streamed, end)
        return piece

    def finish(self, reason: str | None = None) -> GenerationResult:
        """Close the sequence (``reason`` for a cancellation) and build its result."""
        if reason is not None and self.finish_reason is None:
            self.finish_reason = reason
        self.stop_hold.feed(self.detokenizer.flush())
        if self.first_verify_at is not None:
            self.stats.decode_seconds = time.perf_counter() - self.first_verify_at
        self.stats.completion_tokens = len(self.output)
        text = self.stop_hold.text
        for source in self.sources:
            if isinstance(source, PredictionSource):
                accepted, rejected = prediction_token_usage(source.text, source.token_starts, text)
                self.stats.accepted_prediction_tokens, self.stats.rejected_prediction_tokens = accepted, rejected
        return GenerationResult(token_ids=self.output, text=text, finish_reason=self.finish_reason,
                                stats=self.stats, token_origins=self.origins, logprobs=self.logprobs,
                                prompt_logprobs=self.prompt_logprobs,
                                seed=self.sampler.seed if self.sampler is not None else None)
