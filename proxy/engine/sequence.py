"""One request in flight: everything the batched step needs to know about it, and what a round
does to it (accept tokens, stop, stream text, count).

A sequence's KV cache holds every token except the newest one, the *pending* token. Each step
feeds it ``[uncached prompt tokens] + [pending] + draft``; the logits of the last ``k + 1`` rows
verify the draft (see ``engine.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from foretell.proxy.engine.draft_sources import PredictionEncoding
from foretell.proxy.engine.grammar import Grammar
from foretell.proxy.engine.kv_cache import SequenceBlocks
from foretell.proxy.engine.sampling import SpeculativeSampler
from foretell.proxy.engine.speculation import Output, Speculation, draft_sources
from foretell.proxy.engine.stats import GenerationStats


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int = 256
    prediction: str | None = None
    # The prediction tokenised (``PredictionEncoding.of``) where the caller did it off the
    # engine's thread; None: the engine tokenises it when the request is admitted.
    prediction_encoding: PredictionEncoding | None = None
    # Prompt lookup: None means "as the fallback when a prediction is given, else off".
    prompt_lookup: bool | None = None
    # The tenant scope of the engine's draft cache of earlier outputs (``draft_cache.py``) this
    # request drafts from and adds its output to; None: it neither drafts from nor feeds it.
    draft_cache_scope: str | None = None
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
    # The grammar the output must follow (``grammar.Grammar``: structured output), its own
    # copy; None: free text.
    grammar: Grammar | None = None
    # Drafts from the engine's draft model (``draft_model.py``): None means "where the request
    # brings no prediction" (a prediction drafts better, and the draft would prefill for nothing).
    draft_model: bool | None = None


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
    """A request in flight in the engine: its speculation (``speculation.py``: sources, output,
    statistics, shared with remote verification) plus its place in the KV cache, its sampler and
    its log-probabilities. It holds the speculation rather than extending it, so that its own
    ``accept`` (with log-probabilities) keeps a signature of its own."""

    def __init__(self, request: GenerationRequest, max_tokens: int, tokenizer, device,
                 eos_token_ids: frozenset[int], blocks: SequenceBlocks, draft_cache=None):
        self.request = request
        self.prompt = list(request.prompt_ids)
        eos = frozenset(eos_token_ids) | frozenset(request.stop_token_ids)
        self.speculation = Speculation(
            Output(tokenizer, request.stop, max_tokens, eos),
            draft_sources(tokenizer, self.prompt, request.prediction, request.prompt_lookup,
                          request.prediction_encoding),
            request.max_draft, prompt_tokens=len(self.prompt))
        self.blocks = blocks
        self.sampler = None
        if request.temperature > 0:
            self.sampler = SpeculativeSampler(request.temperature, request.top_k, request.top_p,
                                              request.seed, device)
        self.logprobs: list[TokenLogprob] | None = [] if request.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprob] | None = (
            [] if request.prompt_logprobs is not None else None)
        self.pending = self.prompt[-1]
        self.grammar = request.grammar
        self.admitted_at = time.perf_counter()
        # Set by a caller that counts the prediction's usage itself, off the engine's thread
        # (``Speculation.count_prediction_usage``; the scheduler does).
        self.defer_prediction_usage = False
        self.first_verify_at: float | None = None
        if draft_cache is not None and request.draft_cache_scope is not None:  # last: it opens an entry
            self.speculation.add_source(draft_cache.source(request.draft_cache_scope, self.prompt))

    # What the engine reads of the speculation, named here.
    @property
    def stats(self) -> GenerationStats:
        return self.speculation.stats

    @property
    def output(self) -> Output:
        return self.speculation.output

    @property
    def finished(self) -> bool:
        return self.speculation.finished

    @property
    def draft(self) -> list:
        """The draft chosen for this round (``set_draft``), verified after the pending token."""
        return self.speculation.draft

    @property
    def wants_draft_model(self) -> bool:
        wanted = self.request.draft_model
        return wanted if wanted is not None else not self.request.prediction

    @property
    def draft_probs(self):
        """The q rows [k, V] the round's draft was drawn from (the draft model sampling), else
        None: drafts copied from text, point masses."""
        source = self.speculation.source(self.speculation.draft_source) if self.speculation.draft_source else None
        probs = getattr(source, "draft_probs", None)
        return None if probs is None else probs[:len(self.draft)]

    @property
    def uncached_prompt(self) -> int:
        """Prompt tokens before the pending one whose K/V is not in the cache yet."""
        return max(0, len(self.prompt) - 1 - self.blocks.committed)

    def accept(self, accepted: int, new_tokens: list[int], logprobs: list[TokenLogprob] | None) -> SequenceUpdate:
        """Take a round's verified tokens up to where plain decoding would have stopped."""
        if self.first_verify_at is None:
            self.first_verify_at = time.perf_counter()
            self.stats.prefill_seconds = self.first_verify_at - self.admitted_at
        kept = self.speculation.accept(accepted, new_tokens)
        if self.grammar is not None:
            self.grammar.advance(kept)
        if logprobs is not None:
            logprobs = logprobs[: len(kept)]
            self.logprobs.extend(logprobs)
        self.pending = kept[-1]
        result = self.finish() if self.finished else None
        origins = self.speculation.origins
        return SequenceUpdate(self, kept, self.output.release(), origins[len(origins) - len(kept):],
                              logprobs, result=result)

    def finish(self, reason: str | None = None) -> GenerationResult:
        """Close the sequence (``reason`` for a cancellation) and build its result (its prediction
        usage still to count where ``defer_prediction_usage`` is set)."""
        self.speculation.close(reason, count_usage=not self.defer_prediction_usage)
        if self.first_verify_at is not None:
            self.stats.decode_seconds = time.perf_counter() - self.first_verify_at
        return GenerationResult(token_ids=self.output.keys, text=self.output.text,
                                finish_reason=self.speculation.finish_reason, stats=self.stats,
                                token_origins=self.speculation.origins, logprobs=self.logprobs,
                                prompt_logprobs=self.prompt_logprobs,
                                seed=self.sampler.seed if self.sampler is not None else None)
