"""The speculative generation engine: propose -> verify -> accept -> roll back, for many
sequences in one target pass.

A *step* runs one forward pass over every scheduled sequence's new positions, flattened into one
ragged batch (``[num_tokens]`` ids, ``[num_verify_rows, V]`` logits with per-sequence offsets;
never padded to ``[B, K+1, V]``), attended in one kernel launch per layer on CUDA
(``kernel_choice.py``) and verified in one launch per kind, every sequence at once
(``verify.py``, vLLM's flat layout):

- a sequence still in prefill feeds its next chunk of prompt tokens;
- a running sequence feeds ``[pending] + draft`` (the last prefill chunk may be followed by
  them in the same pass), and the logits of those ``k + 1`` rows verify the draft:
  - greedy (temperature 0): the verify kernel keeps the longest prefix of the draft that equals
    the target's choices and appends the target's own token at the first mismatch (*recovered*)
    or after a fully accepted draft (*bonus*): exactly the tokens of plain greedy decoding;
  - sampling (temperature > 0): the rejection-sampling kernel accepts each draft token x with
    probability p(x) and draws the recovered token from p without x (or the bonus from p), with
    the sequence's own seeded generator, so its tokens follow exactly the target's sampling
    distribution whatever else shares the pass (see ``sampling.py``).

A sequence with a grammar (structured output, ``grammar.py``) has each of its ``k + 1`` rows
masked to the tokens the grammar allows there (after the draft tokens before it) before either
kind verifies, its draft cut before the first token the grammar forbids; the masks are computed
on a worker thread while the pass runs.

Rollback is free: the paged cache (``kv_cache.py``) writes every fed position at its slot and a
sequence's committed length advances only past the pending token and the accepted drafts; the
rejected slots are overwritten later. Every round yields at least one token. The draft lengths of
a step are chosen together from the fitted cost of a pass over all its positions
(``draft_length.choose_step_drafts``). ``generate()`` is the same step with one sequence.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from foretell.proxy.engine.draft_length import (
    DEFAULT_PASS_COST,
    DEFAULT_SAMPLING_COST,
    OnlinePassCost,
    PassCostModel,
    choose_step_drafts,
)
from foretell.proxy.engine.grammar import MaskJob, mask_rows
from foretell.proxy.engine.invariant_linear import Int8DynamicLinear
from foretell.proxy.engine.kernel_choice import AttentionShape, choose_kernels
from foretell.proxy.engine.draft_model import DraftModel
from foretell.proxy.engine.forward import forward_pass, measure_pass_cost
from foretell.proxy.engine.kv_cache import CacheFullError, PagedKVCache, SequenceBlocks
from foretell.proxy.engine.lean_layers import use_lean_layers
from foretell.proxy.engine.precision import (default_fp32_head, describe, head_rows,
                                             native_head_candidates)
from foretell.proxy.engine.prompt_logprob_cache import PromptLogprobCache
from foretell.proxy.engine.sampling import SpeculativeSampler
from foretell.proxy.engine.verify import VerifyRows, verify_step
from foretell.proxy.engine.sequence import GenerationRequest, GenerationResult, Sequence, SequenceUpdate, TokenLogprob
from foretell.proxy.engine.stats import GenerationStats, SourceStats
from foretell.proxy.options import KV_CACHE_TOKENS, MAX_RUNNING, PREFILL_CHUNK

__all__ = ["CacheFullError", "GenerationRequest", "GenerationResult", "GenerationStats",
           "Sequence", "SequenceUpdate", "SourceStats", "SpeculativeEngine", "TokenLogprob"]

# Drafted positions one pass may verify in all: bounds the [rows, V] logits (1 MB a row at V=262k).
DEFAULT_MAX_DRAFT_POSITIONS = 512


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
    """Greedy or sampled generation for many sequences at once, with drafts from predictions,
    prompt lookup and the draft cache of earlier outputs, verified exactly."""

    def __init__(self, model, tokenizer, pass_cost: PassCostModel | None = None, *,
                 kv_cache_tokens: int = KV_CACHE_TOKENS, block_size: int = 16,
                 prefill_chunk: int = PREFILL_CHUNK, max_sequences: int = MAX_RUNNING,
                 max_draft_positions: int = DEFAULT_MAX_DRAFT_POSITIONS,
                 dtype: torch.dtype | None = None, fp32_head: bool | None = None,
                 kernels: str | None = None, draft_cache=None, draft_model=None,
                 draft_model_name: str = "draft"):
        """``dtype`` casts ``model`` in place (None: as loaded, see ``model_loader.load_model``
        for --dtype and --quantize); ``fp32_head`` scores each row's leading tokens in float32
        over a bf16/fp16 head (None: on for such a head, ``precision.default_fp32_head``);
        ``kernels`` is auto, triton or reference (None: ``FORETELL_KERNELS``, else auto; see
        ``kernel_choice.py``): Triton kernels are checked against their references here.
        ``draft_cache``: a ``draft_cache.DraftCache`` that requests with a ``draft_cache_scope``
        draft from and feed (None: no drafts across requests). ``draft_model``: a smaller model with
        the same tokenizer (``draft_model.load_draft_model``) drafting for requests beside the
        other sources, ``draft_model_name`` what ``/health`` calls it (None: no draft model)."""
        if prefill_chunk < 1 or kv_cache_tokens < block_size:
            raise ValueError("prefill_chunk must be >= 1 and kv_cache_tokens >= block_size")
        if dtype is not None:
            model.to(dtype)
        self.model = model
        self.dtype = model.get_input_embeddings().weight.dtype
        self.quantization = getattr(model, "foretell_quantization", "none")
        # int8 x int8 linears (invariant_linear.py): every row's bits independent of the pass, so the
        # attention is made so too (invariant_attention.py).
        self.batch_invariant = bool(getattr(model, "foretell_batch_invariant", False))
        self.fp32_head = _fp32_head(model, self.dtype, self.quantization, fp32_head)
        if self.fp32_head:
            native_head_candidates()  # loaded now (built by setup), rather than in the first pass
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.prefill_chunk = prefill_chunk
        self.max_draft_positions = max_draft_positions
        self.cost = OnlinePassCost(pass_cost or DEFAULT_PASS_COST)
        self.sampling_cost = DEFAULT_SAMPLING_COST
        self.eos_token_ids = _eos_token_ids(model, tokenizer)
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        window = getattr(model.config, "sliding_window", None) or 0
        # Sliding layers hold a window per running sequence, plus cached prompt blocks.
        sliding_tokens = min(kv_cache_tokens,
                             max_sequences * (window + prefill_chunk + max_draft_positions + 4 * block_size))
        self.cache = PagedKVCache(model, kv_cache_tokens, block_size, sliding_tokens=sliding_tokens)
        self.kernels = choose_kernels(kernels, self.device, self.dtype, AttentionShape(
            self.cache.heads, self.cache.kv_heads, self.cache.head_dim, block_size, self.cache.window))
        self.cache.attention_kernel = self.kernels.paged_attention
        self.cache.batch_invariant = self.batch_invariant and self.kernels.paged_attention is None
        self.prompt_logprob_cache = PromptLogprobCache(max_positions=kv_cache_tokens)
        self.draft_cache = draft_cache
        # int8 x int8: Gemma 3's decoder layers as one function each, where that gives their bits
        # (lean_layers.py: ~1 ms of a ~21 ms plain step in module calls).
        self.lean_layers = (any(isinstance(m, Int8DynamicLinear) for m in model.modules())
                            and use_lean_layers(model, self.cache, self.fp32_head))
        self.draft_model = None
        if draft_model is not None:
            self.draft_model = DraftModel(draft_model, draft_model_name, model.config.vocab_size,
                                          kv_cache_tokens=kv_cache_tokens, block_size=block_size,
                                          sliding_tokens=sliding_tokens, kernels=kernels)

    @property
    def precision(self) -> str:
        """The precision the engine runs at, e.g. ``bfloat16+fp32-head`` (``precision.describe``)."""
        return describe(self.dtype, self.quantization, self.fp32_head)

    @property
    def native_loops(self) -> list[str]:
        """The native CPU loops (``foretell/kernels/*.cpp``) this engine's passes run: where one
        is missing (no compiler, or bits unlike torch's) its torch operations serve, slower."""
        from foretell.proxy.engine.invariant_linear import native_int8_rows
        from foretell.proxy.engine.invariant_norm import RowInvariantRMSNorm

        modules = list(self.model.modules())
        loops = ["attention"] if self.cache.batch_invariant and self.cache.row_attention is not None else []
        if any(isinstance(m, Int8DynamicLinear) for m in modules) and native_int8_rows() is not None:
            loops.append("int8 rows")
        if any(isinstance(m, RowInvariantRMSNorm) for m in modules):
            loops.append("rms norm")
        return loops

    @property
    def pass_cost(self) -> PassCostModel:
        """The current fit of a pass's cost by its positions."""
        return self.cost.model

    # ---- admitting and retiring sequences ----------------------------------------------------

    def _check(self, request: GenerationRequest) -> tuple[int, int, int]:
        """Validate a request; return (max_tokens, positions, largest single feed)."""
        prompt = request.prompt_ids
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        if request.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        max_tokens = request.max_tokens
        if self.max_positions is not None:
            room = self.max_positions - len(prompt)
            if room < 1:
                raise ValueError(f"the prompt has {len(prompt)} tokens; the model's context is {self.max_positions}")
            max_tokens = min(max_tokens, room)
        positions = len(prompt) + max_tokens
        max_query = self.prefill_chunk + 1 + min(request.max_draft, self.max_draft_positions)
        self.cache.check_fits(positions, max_query)
        return max_tokens, positions, max_query

    def add(self, request: GenerationRequest) -> Sequence | None:
        """Admit a request: its blocks are reserved and its prompt prefix looked up in the
        prefix cache. None when the cache cannot hold it now (retry after others finish);
        ValueError (``CacheFullError`` among them) when it is invalid or can never fit."""
        max_tokens, positions, max_query = self._check(request)
        blocks = self.cache.reserve(positions, max_query)
        if blocks is None:
            return None
        seq = Sequence(request, max_tokens, self.tokenizer, self.device, self.eos_token_ids, blocks, self.draft_cache)
        if self.draft_model is not None and seq.wants_draft_model:
            source = self.draft_model.source(seq.prompt, positions, max_query,
                                            seq.sampler.seed if seq.sampler is not None else None)
            if source is not None:  # else the draft's cache is full now: it runs without
                seq.speculation.add_source(source)
        if request.prompt_logprobs is None:
            seq.stats.cached_tokens = self.cache.match_prefix(blocks, seq.prompt)
        else:  # a cached prefix serves only as far as its prompt logprobs are known
            known = self.prompt_logprob_cache.lookup(seq.prompt, request.prompt_logprobs)
            if known:
                reused = self.cache.match_prefix(blocks, seq.prompt[: len(known) + 1])
                seq.prompt_logprobs.extend(known[:reused])
                seq.stats.cached_tokens = reused
        return seq

    def abort(self, seq: Sequence) -> GenerationResult:
        """Cancel a sequence and free its blocks at once."""
        result = seq.finish("cancelled")
        self.cache.free(seq.blocks)
        return result

    # ---- one step --------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, sequences: list[Sequence]) -> list[SequenceUpdate]:
        """One target pass over ``sequences`` (in priority order: earlier ones get the prefill
        budget first). Returns an update for every sequence that verified tokens or failed;
        finished sequences have their blocks freed."""
        plan = self._plan(sequences)
        if not plan:
            return []
        feeds, masks = [], MaskJob()
        for seq, chunk, verifies in plan:
            start = seq.blocks.committed
            tokens = seq.prompt[start:start + chunk]
            # Logits from the verify rows on; from the chunk's first row for prompt logprobs.
            logits_from = chunk if verifies else None
            if seq.prompt_logprobs is not None and chunk > 0:
                logits_from = 0
            if verifies:
                tokens = tokens + [seq.pending] + seq.draft
                if seq.grammar is not None:  # its rows' masks, computed while the pass runs
                    masks.start(seq, seq.grammar, seq.draft)
            feeds.append((seq.blocks, tokens, logits_from))
        started = time.perf_counter()
        logits = self._forward(feeds)
        allowed = masks.wait()
        updates, verifying, unmasked, row = [], [], {}, 0
        for seq, chunk, verifies in plan:
            if seq.prompt_logprobs is not None and chunk > 0:
                # Row i is the distribution of the prompt token after position committed + i.
                start = seq.blocks.committed
                seq.prompt_logprobs.extend(token_logprobs(
                    logits[row:row + chunk], seq.prompt[start + 1:start + chunk + 1],
                    seq.request.prompt_logprobs))
                row += chunk
                if verifies:  # the prompt is complete
                    self.prompt_logprob_cache.store(seq.prompt, seq.request.prompt_logprobs,
                                                    seq.prompt_logprobs)
            if not verifies:
                seq.blocks.committed += chunk
                continue
            rows = logits[row:row + len(seq.draft) + 1]  # [k+1, V]
            if seq.grammar is not None and (error := _apply_masks(seq, rows, allowed[seq], unmasked)):
                seq.finish("error")
                updates.append(SequenceUpdate(seq, [], "", [], error=error))
                row += len(seq.draft) + 1
                continue
            verifying.append((seq, chunk, VerifyRows(row, seq.draft, seq.sampler, seq.draft_probs)))
            row += len(seq.draft) + 1
        outcomes = verify_step(self.kernels, logits, [entry for _, _, entry in verifying])
        for (seq, chunk, entry), outcome in zip(verifying, outcomes):
            try:
                if isinstance(outcome, Exception):
                    raise outcome
                accepted, new_tokens = outcome
                rows = unmasked.get(seq, logits[entry.first_row:entry.first_row + len(entry.draft) + 1])  # [k+1, V]
                logprobs = (token_logprobs(rows, new_tokens, seq.request.logprobs)
                            if seq.logprobs is not None else None)
                seq.blocks.committed += chunk + 1 + accepted  # the pending token + accepted drafts
                updates.append(seq.accept(accepted, new_tokens, logprobs))
            except Exception as error:  # this sequence fails; the others in the pass go on
                seq.finish("error")
                updates.append(SequenceUpdate(seq, [], "", [], error=error))
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.cost.observe(sum(len(tokens) for _, tokens, _ in feeds), time.perf_counter() - started)
        for seq, _, _ in plan:
            # A finished sequence's prompt is cached too (a one-token request's included).
            self.cache.register_prompt_blocks(seq.blocks, seq.prompt)
            if seq.finished:
                self.cache.free(seq.blocks)
            else:
                self.cache.release_behind_window(seq.blocks)
        return updates

    def _plan(self, sequences: list[Sequence]) -> list[tuple[Sequence, int, bool]]:
        """Each sequence's prefill chunk and whether it verifies this step; drafts chosen."""
        plan, budget = [], self.prefill_chunk
        for seq in sequences:
            if seq.finished:
                continue
            chunk = min(seq.uncached_prompt, budget)
            if seq.uncached_prompt and chunk == 0:
                continue  # waits for the next step's prefill budget
            budget -= chunk
            plan.append((seq, chunk, chunk == seq.uncached_prompt))
        verifying = [seq for seq, _, verifies in plan if verifies]
        fixed = sum(chunk for _, chunk, _ in plan) + len(verifying)
        # A sampled sequence's random draws follow its draft lengths, and a seed must replay
        # whatever else is in flight: it drafts by its own history against the fixed prior cost
        # (the start-up figure), never by the load or the online fit.
        alone = self.cost.prior + self.sampling_cost
        choices = []  # (sequence, source, length)
        for seq in verifying:
            if seq.sampler is not None:
                source, length = choose_step_drafts([seq.speculation.draft_options()], 1, alone)[0]
                choices.append((seq, source, length))
                fixed += length
        greedy = [seq for seq in verifying if seq.sampler is None]
        chosen = choose_step_drafts([seq.speculation.draft_options() for seq in greedy], fixed, self.pass_cost,
                                    max_positions=fixed + self.max_draft_positions)
        choices += [(seq, source, length) for seq, (source, length) in zip(greedy, chosen)]
        if self.draft_model is not None:  # the draft model's chosen drafts, and its prefill
            self.draft_model.run(plan, choices)
        for seq, source, length in choices:
            _set_draft(seq, source, length)
        return plan

    def _forward(self, feeds: list[tuple[SequenceBlocks, list[int], int | None]]) -> torch.Tensor:
        """One target pass over ``feeds`` (``forward.forward_pass``): their logits [rows, V]."""
        return forward_pass(self.model, self.cache, feeds, self.fp32_head)

    # ---- one request alone -----------------------------------------------------------------------

    def generate(
        self,
        request: GenerationRequest,
        on_tokens: Callable[[list[int], str, list[TokenLogprob] | None], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        on_update: Callable[[SequenceUpdate], None] | None = None,
    ) -> GenerationResult:
        """Generate one request: the batched step with a single sequence.

        ``on_tokens(new_ids, new_text, new_logprobs)`` (or ``on_update(update)``, which also
        carries each token's origin) is called after every round; ``should_stop()`` returning
        True cancels the request."""
        seq = self.add(request)
        if seq is None:  # only cached prefixes can hold blocks now, and they are evictable
            raise CacheFullError("the KV cache is busy")
        try:
            while True:
                if should_stop is not None and should_stop():
                    return self.abort(seq)
                for update in self.step([seq]):
                    if update.error is not None:
                        raise update.error
                    if on_tokens is not None:
                        on_tokens(update.token_ids, update.text, update.logprobs)
                    if on_update is not None:
                        on_update(update)
                    if update.result is not None:
                        return update.result
        except BaseException:
            if not seq.finished:
                self.abort(seq)
            raise

    # ---- cost calibration ------------------------------------------------------------------

    @torch.inference_mode()
    def calibrate(self, context_tokens: int = 256, positions=(1, 17, 65)) -> PassCostModel:
        """Measure this model's pass cost on this machine (about a second on a 2-core CPU); the
        figure becomes the prior of the online fit, which then follows the passes actually run."""
        measured = measure_pass_cost(self.model, self.cache, positions, context_tokens, self.fp32_head)
        self.cost.reset(measured)

        # Random logits and drafts made once, outside the timing: only the verify is measured.
        sampler = SpeculativeSampler(temperature=1.0, seed=0, device=self.device)
        logits = torch.randn(max(positions), self.model.config.vocab_size, device=self.device)
        drafts = logits.argmax(dim=-1).tolist()

        def sample(n: int) -> None:
            (outcome,) = verify_step(self.kernels, logits[:n], [VerifyRows(0, drafts[: n - 1], sampler)])
            if isinstance(outcome, Exception):  # never time a failing verify as if it worked
                raise outcome

        self.sampling_cost = PassCostModel.measure(sample, positions=positions)
        return measured


def _fp32_head(model, dtype: torch.dtype, quantization: str, asked: bool | None) -> bool:
    """Whether each row's leading tokens are rescored in float32: where the head's logits are
    approximate (bf16/fp16, or int8 x int8) and its weight rows can be read; ``asked`` None:
    ``precision.default_fp32_head``."""
    rescorable = head_rows(model.get_output_embeddings()) is not None
    if asked is None:
        asked = default_fp32_head(dtype, quantization) and rescorable
    elif asked and not rescorable:
        raise ValueError("the fp32 head reads the head's weight rows: it needs an unquantized "
                         "or int8 output head")
    return asked and (dtype != torch.float32 or isinstance(model.get_output_embeddings(), Int8DynamicLinear))


def _eos_token_ids(model, tokenizer) -> frozenset[int]:
    eos = model.generation_config.eos_token_id if model.generation_config else None
    eos = tokenizer.eos_token_id if eos is None else eos
    return frozenset(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}


def _apply_masks(seq: Sequence, rows: torch.Tensor, allowed, unmasked: dict) -> Exception | None:
    """Mask a grammar's sequence's rows [k+1, V] in place (a copy from before kept in
    ``unmasked`` where it reports log-probabilities: the model's own); the error that computing
    its masks raised, if any."""
    if isinstance(allowed, Exception):
        return allowed
    if seq.logprobs is not None:
        unmasked[seq] = rows.clone()
    mask_rows(rows, allowed)
    return None


def _set_draft(seq: Sequence, source: str | None, length: int) -> int:
    """Set the round's draft, cut before the first token its grammar forbids (it would be
    rejected there: no position is spent on it); its length."""
    length = min(length, len(seq.speculation.proposals.get(source, ()))) if source is not None else 0
    seq.speculation.set_draft(source, length)
    if seq.grammar is not None and seq.draft:
        allowed = seq.grammar.allowed(seq.draft)
        if allowed < len(seq.draft):
            seq.speculation.set_draft(source, allowed)
    return len(seq.draft)
