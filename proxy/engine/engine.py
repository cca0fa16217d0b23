"""The speculative generation engine: propose -> verify -> accept -> roll back.

One request at a time. The KV cache always holds every token except the newest one (the
*pending* token). A round feeds ``[pending] + draft`` through the target in one pass, so the
logits at position j are the target's distribution after the j-th draft token.

- Greedy (temperature 0): the verify kernel keeps the longest prefix of the draft that equals the
  target's choices and appends the target's own token at the first mismatch (*recovered*) or
  after a fully accepted draft (*bonus*); the tokens are exactly those of plain greedy decoding.
- Sampling (temperature > 0): the rejection-sampling kernel accepts each draft token x with
  probability p(x) and draws the recovered token from p without x (or the bonus token from p), so
  the tokens follow exactly the target's sampling distribution (see ``sampling.py``).

The cache is then cropped back to the accepted tokens. Every round yields at least one token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import DynamicCache

from foretell.kernels import greedy_verify
from foretell.proxy.engine.draft_length import (
    DEFAULT_PASS_COST,
    DEFAULT_SAMPLING_COST,
    AcceptanceEstimate,
    PassCostModel,
    best_draft_length,
)
from foretell.proxy.engine.draft_sources import PredictionSource, PromptLookupSource
from foretell.proxy.engine.prediction_usage import prediction_token_usage
from foretell.proxy.engine.sampling import SpeculativeSampler
from foretell.proxy.engine.stopping import decide_stop, stable_text


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int = 256
    prediction: str | None = None
    # Prompt lookup: None means "as the fallback when a prediction is given, else off".
    prompt_lookup: bool | None = None
    stop: tuple[str, ...] = ()
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


@dataclass
class SourceStats:
    rounds: int = 0  # rounds in which this source's draft was verified
    drafted: int = 0
    accepted: int = 0


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    target_passes: int = 0  # forward passes after the prefill
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    per_source: dict[str, SourceStats] = field(default_factory=dict)
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    # Draft tokens verified / accepted at each position of a draft (vLLM's per-position view).
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
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

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "target_passes": self.target_passes,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "per_source": {name: vars(s).copy() for name, s in self.per_source.items()},
            "accepted_prediction_tokens": self.accepted_prediction_tokens,
            "rejected_prediction_tokens": self.rejected_prediction_tokens,
            "prefill_seconds": round(self.prefill_seconds, 4),
            "decode_seconds": round(self.decode_seconds, 4),
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
    finish_reason: str  # "stop", "length" or "cancelled"
    stats: GenerationStats
    # Per output token: the draft source it was accepted from, or None for the target's own.
    token_origins: list[str | None] = field(default_factory=list)
    # Per output token when the request asked for logprobs, else None.
    logprobs: list[TokenLogprob] | None = None
    seed: int | None = None  # the seed a sampled request ran with (its own or a fresh one)


def new_cache(model) -> DynamicCache:
    """A KV cache that can be rolled back.

    Built from the model's config, sliding-window layers (Gemma 3) keep only their window, so
    attention there stays short on long contexts, as in ``generate()``. Past recording lets
    them hold a round's extra states until ``crop`` drops the rejected ones and trims the rest
    back to the window; every forward pass must therefore be followed by a ``crop``.
    """
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()
    return cache


def prefill(model, prompt_ids: list[int]) -> DynamicCache:
    """Run the prompt except its last token into a fresh KV cache (the last one is pending)."""
    cache = new_cache(model)
    if len(prompt_ids) > 1:
        device = next(model.parameters()).device
        prefix = torch.tensor([prompt_ids[:-1]], device=device)
        model(input_ids=prefix, cache=cache, use_cache=True, logits_to_keep=1)
        cache.crop(0)  # trim sliding-window layers back to their window
    return cache


def verify_draft(model, cache: DynamicCache, pending: int, draft: list[int],
                 sampler: SpeculativeSampler | None = None) -> tuple[int, list[int], torch.Tensor]:
    """One target pass over ``[pending] + draft``; keep what greedy decoding (no sampler) or
    sampling (with one) would keep.

    Returns (accepted draft tokens, new tokens = accepted drafts + the target's own token, the
    logits [accepted + 1, V] that produced the new tokens). On return the cache holds the pending
    token and the accepted drafts, nothing rejected.
    """
    device = next(model.parameters()).device
    input_ids = torch.tensor([[pending] + draft], device=device)  # [1, k+1]
    logits = model(input_ids=input_ids, cache=cache, use_cache=True).logits  # [1, k+1, V]
    if sampler is None:
        draft_tokens = torch.tensor(draft, dtype=torch.long, device=device).view(1, len(draft))  # [1, k]
        num_draft = torch.tensor([len(draft)], dtype=torch.long, device=device)  # [1]
        num_accepted, output_tokens = greedy_verify(logits, draft_tokens, num_draft)
        accepted = int(num_accepted[0])
        new_tokens = output_tokens[0, : accepted + 1].tolist()
    else:
        accepted, new_tokens = sampler.verify(logits[0], draft)
    cache.crop(accepted - len(draft))  # roll back the rejected positions (0: just trim windows)
    return accepted, new_tokens, logits[0, : accepted + 1]


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Log-probabilities of ``tokens`` under the raw distributions ``logits`` [len(tokens), V]."""
    logprobs = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)  # [n, V]
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logits.device).view(-1, 1))[:, 0]  # [n]
    best = torch.topk(logprobs, min(top, logprobs.shape[-1]), dim=-1) if top > 0 else None
    result = []
    for i, token in enumerate(tokens):
        alternatives = list(zip(best.indices[i].tolist(), best.values[i].tolist())) if best is not None else []
        result.append(TokenLogprob(token, float(chosen[i]), alternatives))
    return result


class SpeculativeEngine:
    """Greedy or sampled generation with drafts from a prediction and/or prompt lookup, verified
    exactly."""

    def __init__(self, model, tokenizer, pass_cost: PassCostModel | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.pass_cost = pass_cost or DEFAULT_PASS_COST
        self.sampling_cost = DEFAULT_SAMPLING_COST
        eos = model.generation_config.eos_token_id if model.generation_config else None
        eos = tokenizer.eos_token_id if eos is None else eos
        self.eos_token_ids = frozenset(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
        self.max_positions = getattr(model.config, "max_position_embeddings", None)

    # ---- cost calibration -------------------------------------------------------------

    @torch.inference_mode()
    def calibrate(self, context_tokens: int = 256, positions=(1, 17, 65)) -> PassCostModel:
        """Measure this model's pass cost on this machine (about a second on a 2-core CPU)."""
        prompt = torch.randint(10, 1000, (1, context_tokens), device=self.device)
        cache = new_cache(self.model)
        self.model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1)
        cache.crop(0)

        def forward(n: int) -> None:
            ids = torch.randint(10, 1000, (1, n), device=self.device)
            self.model(input_ids=ids, cache=cache, use_cache=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            cache.crop(-n)

        self.pass_cost = PassCostModel.measure(forward, positions=positions)

        # Random logits and drafts made once, outside the timing: only the verify is measured.
        sampler = SpeculativeSampler(temperature=1.0, seed=0, device=self.device)
        logits = torch.randn(max(positions), self.model.config.vocab_size, device=self.device)
        drafts = logits.argmax(dim=-1).tolist()

        def sample(n: int) -> None:
            sampler.verify(logits[:n], drafts[: n - 1])

        self.sampling_cost = PassCostModel.measure(sample, positions=positions)
        return self.pass_cost

    # ---- generation ---------------------------------------------------------------------

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    @torch.inference_mode()
    def generate(
        self,
        request: GenerationRequest,
        on_tokens: Callable[[list[int], str, list[TokenLogprob] | None], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> GenerationResult:
        """Generate. ``on_tokens(new_ids, new_text, new_logprobs)`` is called after every round
        with the tokens just verified (``new_logprobs`` is None unless the request asked for
        logprobs); ``should_stop()`` returning True cancels the request."""
        prompt = list(request.prompt_ids)
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        if request.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        max_tokens = request.max_tokens
        if self.max_positions is not None:
            room = self.max_positions - len(prompt)
            if room < 1:
                raise ValueError(
                    f"the prompt has {len(prompt)} tokens; the model's context is {self.max_positions}"
                )
            max_tokens = min(max_tokens, room)

        sources = []
        if request.prediction:
            sources.append(PredictionSource(self.tokenizer, request.prediction))
        use_lookup = request.prompt_lookup if request.prompt_lookup is not None else bool(request.prediction)
        if use_lookup:
            sources.append(PromptLookupSource(prompt))
        sampler = None
        if request.temperature > 0:
            sampler = SpeculativeSampler(request.temperature, request.top_k, request.top_p,
                                         request.seed, self.device)
        logprobs = [] if request.logprobs is not None else None
        cost_model = self.pass_cost if sampler is None else self.pass_cost + self.sampling_cost
        estimates = {s.name: AcceptanceEstimate() for s in sources}
        stats = GenerationStats(prompt_tokens=len(prompt))
        stats.per_source = {s.name: SourceStats() for s in sources}

        started = time.perf_counter()
        cache = prefill(self.model, prompt)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        stats.prefill_seconds = time.perf_counter() - started

        started = time.perf_counter()
        pending = prompt[-1]
        output: list[int] = []
        origins: list[str | None] = []
        text = ""  # stable completion text so far
        finish_reason = None
        while finish_reason is None:
            if should_stop is not None and should_stop():
                finish_reason = "cancelled"
                break
            room = max_tokens - len(output)
            # A round yields draft + 1 tokens at most, so never draft past max_tokens.
            proposals = {s.name: s.propose(min(request.max_draft, room - 1)) for s in sources}
            runs = {s.name: s.agreement_run() for s in sources}
            source_name, draft = self._choose_draft(proposals, estimates, runs, cost_model)

            accepted, new_tokens, rows = verify_draft(self.model, cache, pending, draft, sampler)
            stats.target_passes += 1
            decision = decide_stop(
                new_tokens, output, len(text), self.decode,
                eos_token_ids=self.eos_token_ids, stop=request.stop, max_tokens=max_tokens,
            )
            new_tokens = new_tokens[: decision.keep]
            finish_reason = decision.finish_reason
            accepted = min(accepted, len(new_tokens))  # drafts past a stop do not count
            if source_name is not None:
                record = stats.per_source[source_name]
                record.rounds += 1
                record.drafted += len(draft)
                record.accepted += accepted
                stats.drafted_tokens += len(draft)
                stats.accepted_tokens += accepted
                stats.count_positions(len(draft), accepted)
            for name, proposal in proposals.items():
                estimates[name].update(proposal, new_tokens)
            round_logprobs = None
            if logprobs is not None:
                round_logprobs = token_logprobs(rows, new_tokens, request.logprobs)
                logprobs.extend(round_logprobs)
            output.extend(new_tokens)
            origins.extend([source_name] * accepted + [None] * (len(new_tokens) - accepted))
            pending = new_tokens[-1]

            full_text = self.decode(output)
            if decision.text_end is not None:
                full_text = full_text[: decision.text_end]
            new_stable = full_text if finish_reason else stable_text(full_text)
            delta, text = new_stable[len(text):], new_stable
            for source in sources:
                source.observe(output, text)
            if on_tokens is not None:
                on_tokens(new_tokens, delta, round_logprobs)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        stats.decode_seconds = time.perf_counter() - started
        stats.completion_tokens = len(output)

        for source in sources:
            if isinstance(source, PredictionSource):
                accepted, rejected = prediction_token_usage(source.text, source.token_starts, text)
                stats.accepted_prediction_tokens, stats.rejected_prediction_tokens = accepted, rejected
        return GenerationResult(token_ids=output, text=text, finish_reason=finish_reason,
                                stats=stats, token_origins=origins, logprobs=logprobs,
                                seed=sampler.seed if sampler is not None else None)

    def _choose_draft(self, proposals: dict[str, list[int]], estimates: dict[str, AcceptanceEstimate],
                      runs: dict[str, float | None], cost_model: PassCostModel):
        """Pick the source and draft length with the best expected tokens per unit of cost."""
        best_name, best_length = None, 0
        best_rate = 1.0 / cost_model.cost(0)
        for name, proposal in proposals.items():
            length, rate = best_draft_length(estimates[name].rate, len(proposal), cost_model,
                                             runs.get(name))
            if length > 0 and rate > best_rate:
                best_name, best_length, best_rate = name, length, rate
        if best_name is None:
            return None, []
        return best_name, proposals[best_name][:best_length]
