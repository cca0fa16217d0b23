"""The draft model: a smaller model with the target's tokenizer (or a cheaper copy of the target,
``self:int8``) that proposes the next tokens, the seed chapter's first kind of draft.

It is one more draft source beside the prediction, prompt lookup and the draft cache, weighed
by the same chooser: its option carries the cost of its own passes (``DraftOption.pass_cost``),
so it drafts only where its expected tokens pay for them. Unlike the model-free sources it
cannot propose before it is chosen: once a step's drafts are chosen, ``DraftModel.run`` drafts
the chosen lengths for every sequence that drafts from it, in batched passes:

- pass 1 feeds each such sequence's tokens the draft's cache has not seen yet (its *lag*: the
  pending token, and the last round's verified tokens), and beside them the prompt chunks the
  target prefills in this step, so the draft keeps up with prefill without passes of its own;
- pass j (2..k) feeds the token pass j - 1 drafted, for the sequences drafting at least j.

Greedy sequences take each row's argmax. A sampled sequence draws each token from the draft's
distribution q (the request's temperature, top-k and top-p over the draft's logits) with a
generator of its own seeded from the request's seed, and the verify accepts with min(1, p/q)
against those q rows (``foretell.kernels.rejection_sample``), so its tokens keep the target's
distribution exactly.

The draft's KV cache is paged like the target's (same block tables, prefix reuse of prompts).
Rollback is free there too: after a round the source sets its committed length back to what the
output kept (``DraftModelSource.observe``).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from foretell.proxy.engine.draft_length import DEFAULT_PASS_COST, OnlinePassCost, PassCostModel
from foretell.proxy.engine.draft_sources import common_prefix_length
from foretell.proxy.engine.forward import forward_pass, measure_pass_cost
from foretell.proxy.engine.kernel_choice import AttentionShape, choose_kernels
from foretell.proxy.engine.kv_cache import PagedKVCache, SequenceBlocks
from foretell.proxy.engine.sampling import target_probs

DRAFT_SOURCE = "draft_model"
SELF_PREFIX = "self:"
SELF_QUANTIZATIONS = ("int8", "int4")
# Separates a draft's random stream from the target's for the same request seed.
_DRAFT_SEED_SALT = 0x5DEECE66D


# ---- loading -------------------------------------------------------------------------------

def check_draft_spec(spec: str) -> None:
    """ValueError for a ``--draft-model`` value that cannot name a draft (before any loading)."""
    if spec.startswith(SELF_PREFIX) and spec[len(SELF_PREFIX):] not in SELF_QUANTIZATIONS:
        raise ValueError(f"draft model {spec!r}: a copy of the target is named "
                         f"{' or '.join(SELF_PREFIX + q for q in SELF_QUANTIZATIONS)}")
    if not spec.strip():
        raise ValueError("draft model: give a model path or self:int8")


def load_draft_model(spec: str, target):
    """The draft named by ``spec`` for ``target`` (a ``model_loader.LoadedModel``):
    ``self:int8`` / ``self:int4`` load the target's own weights again at that quantization
    (sharing the target's embedding table); anything else is loaded as ``--model`` is, at the
    target's dtype and quantization, and must have the target's tokenizer. ValueError naming the
    difference otherwise."""
    from foretell.proxy.engine.model_loader import load_model

    check_draft_spec(spec)
    dtype = target.model.get_input_embeddings().weight.dtype
    device = next(target.model.parameters()).device.type
    if spec.startswith(SELF_PREFIX):
        loaded = load_model(str(target.source), device=device, dtype=dtype, quantize=spec[len(SELF_PREFIX):])
        _share_embeddings(target.model, loaded.model)
        loaded.name = spec
        return loaded
    if not Path(spec).expanduser().exists():
        raise ValueError(f"draft model {spec!r} does not exist")
    loaded = load_model(spec, device=device, dtype=dtype,
                        quantize=getattr(target.model, "foretell_quantization", "none"))
    difference = tokenizer_difference(target.tokenizer, loaded.tokenizer)
    if difference is not None:
        raise ValueError(f"draft model {spec!r} has another tokenizer than the target: {difference}")
    return loaded


def _share_embeddings(target, draft) -> None:
    """A copy of the target reads the target's embedding table (a lookup never quantized)."""
    ours, theirs = target.get_input_embeddings(), draft.get_input_embeddings()
    if type(ours) is type(theirs) and ours.weight.shape == theirs.weight.shape and ours.weight.dtype == theirs.weight.dtype:
        head = draft.get_output_embeddings()
        tied = head is not None and getattr(head, "weight", None) is theirs.weight
        if not tied:  # a tied head stays with its own table
            draft.set_input_embeddings(ours)


def tokenizer_difference(target, draft) -> str | None:
    """How the draft's tokenizer differs from the target's (None: the same vocabulary and special
    tokens), in a phrase naming the first difference."""
    if len(draft) != len(target):
        return f"a vocabulary of {len(draft)} tokens, the target's {len(target)}"
    ours, theirs = target.get_vocab(), draft.get_vocab()
    if ours != theirs:
        token = min((t for t in set(ours) | set(theirs) if ours.get(t) != theirs.get(t)), key=str)
        return f"token {token!r} is id {theirs.get(token)} there, {ours.get(token)} in the target's"
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        if getattr(draft, name, None) != getattr(target, name, None):
            return f"{name} {getattr(draft, name, None)}, the target's {getattr(target, name, None)}"
    if sorted(draft.all_special_tokens) != sorted(target.all_special_tokens):
        return f"special tokens {sorted(set(draft.all_special_tokens) ^ set(target.all_special_tokens))} differ"
    return None


# ---- drafting ------------------------------------------------------------------------------

class DraftModel:
    """The draft model in the engine: its KV cache, its pass cost and the step's draft passes."""

    def __init__(self, model, name: str, vocab_size: int, *, kv_cache_tokens: int, block_size: int,
                 sliding_tokens: int | None = None, kernels: str | None = None):
        """``vocab_size``: the target's logit width (the draft's rows are cut or padded to it)."""
        self.model, self.name, self.vocab_size = model, name, vocab_size
        self.device = next(model.parameters()).device
        self.cache = PagedKVCache(model, kv_cache_tokens, block_size, sliding_tokens=sliding_tokens)
        dtype = model.get_input_embeddings().weight.dtype
        self.kernels = choose_kernels(kernels, self.device, dtype, AttentionShape(
            self.cache.heads, self.cache.kv_heads, self.cache.head_dim, block_size, self.cache.window))
        self.cache.attention_kernel = self.kernels.paged_attention
        self.cache.batch_invariant = (bool(getattr(model, "foretell_batch_invariant", False))
                                      and self.kernels.paged_attention is None)
        self.cost = OnlinePassCost(DEFAULT_PASS_COST)

    def source(self, prompt: list[int], positions: int, max_query: int, seed: int | None) -> "DraftModelSource | None":
        """A sequence's draft-model source, its blocks reserved (and its prompt's cached prefix
        reused); None when the draft's cache cannot hold it now (the sequence drafts without
        it). ``seed``: a sampled request's seed (None: greedy)."""
        blocks = self.cache.reserve(positions, max_query)
        if blocks is None:
            return None
        self.cache.match_prefix(blocks, prompt)
        return DraftModelSource(self, prompt, blocks, max_query, seed)

    def release(self, source: "DraftModelSource") -> None:
        self.cache.free(source.blocks)

    @torch.inference_mode()
    def run(self, plan, choices) -> None:
        """Draft this step's chosen lengths and offer them to their sequences' speculations.
        ``plan``: the engine's (sequence, prefill chunk, verifies); ``choices``: (sequence,
        source name, length) of every verifying sequence."""
        drafting = [(seq, seq.speculation.source(DRAFT_SOURCE), length, seq.sampler)
                    for seq, source, length in choices if source == DRAFT_SOURCE and length > 0]
        drafting_sources = {id(source) for _, source, _, _ in drafting}
        feeds, rows_for = [], []
        for seq, chunk, _ in plan:  # the prompt chunks the target prefills, where the draft lags
            source = seq.speculation.source(DRAFT_SOURCE)
            if chunk and source is not None and id(source) not in drafting_sources:
                tokens = source.context[source.blocks.committed:seq.blocks.committed + chunk][:source.max_query]
                if tokens:
                    feeds.append((source, tokens, None))
        for seq, source, length, sampler in drafting:
            lag = source.context[source.blocks.committed:]  # the pending token last
            if len(lag) > source.max_query:  # too far behind to draft this round: it catches up
                feeds.append((source, lag[:source.max_query], None))
            else:
                feeds.append((source, lag, len(lag) - 1))
                rows_for.append((seq, source, length, sampler))
        if not feeds:
            return
        for source, _, _ in feeds:
            self.cache.release_behind_window(source.blocks)  # committed is real here, not a draft
        logits = self._pass([(source.blocks, tokens, first) for source, tokens, first in feeds])
        for source, _, _ in feeds:
            self.cache.register_prompt_blocks(source.blocks, source.context[:source.prompt_length])
        step = 0
        while rows_for:
            for (seq, source, length, sampler), row in zip(rows_for, logits):
                source.push(row, sampler)
            step += 1
            rows_for = [entry for entry in rows_for if entry[2] > step]
            if rows_for:
                logits = self._pass([(source.blocks, source.tokens[-1:], 0) for _, source, _, _ in rows_for])
        for seq, source, _, _ in drafting:
            seq.speculation.offer(DRAFT_SOURCE, list(source.tokens))

    def _pass(self, feeds: list[tuple[SequenceBlocks, list[int], int | None]]) -> torch.Tensor:
        """One draft pass; its wanted rows as the target's vocabulary [rows, V]. Every fed
        position's K/V is then in the cache (committed moves past it)."""
        started = time.perf_counter()
        logits = forward_pass(self.model, self.cache, feeds).float()  # [rows, V_draft]
        for blocks, tokens, _ in feeds:
            blocks.committed += len(tokens)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.cost.observe(sum(len(tokens) for _, tokens, _ in feeds), time.perf_counter() - started)
        width = logits.shape[-1]
        if width > self.vocab_size:  # ids the target's tokenizer never gives
            logits = logits[:, :self.vocab_size]
        elif width < self.vocab_size:
            logits = torch.nn.functional.pad(logits, (0, self.vocab_size - width), value=float("-inf"))
        return logits

    @torch.inference_mode()
    def calibrate(self, context_tokens: int = 256, positions=(1, 5, 17)) -> PassCostModel:
        """Measure a draft pass's cost by its rows (a second or so); the online fit's prior."""
        measured = measure_pass_cost(self.model, self.cache, positions, context_tokens)
        self.cost.reset(measured)
        return measured


class DraftModelSource:
    """One sequence's drafts from the draft model: the context the draft has seen, its blocks in
    the draft's cache, and this round's tokens (with their q rows when sampling)."""

    name = DRAFT_SOURCE
    scores_on_text = False
    drafts_when_chosen = True

    def __init__(self, drafter: DraftModel, prompt: list[int], blocks: SequenceBlocks, max_query: int,
                 seed: int | None):
        self.drafter = drafter
        self.context = list(prompt)  # prompt + output so far; its last token is the pending one
        self.prompt_length = len(prompt)
        self.blocks = blocks
        self.max_query = max_query
        self.tokens: list[int] = []  # drafted this round
        self.probs: list[torch.Tensor] = []  # their q rows [V] (sampled sequences)
        self.generator = None
        if seed is not None:
            self.generator = torch.Generator(device=drafter.device)
            self.generator.manual_seed((seed ^ _DRAFT_SEED_SALT) % 2**64)

    @property
    def pass_cost(self) -> PassCostModel:
        # A seeded request's draft lengths must replay whatever else runs: the fixed prior then.
        return self.drafter.cost.prior if self.generator is not None else self.drafter.cost.model

    @property
    def draft_probs(self) -> torch.Tensor | None:
        """The q rows [k, V] this round's tokens were drawn from; None for greedy drafts."""
        return torch.stack(self.probs) if self.probs else None

    def agreement_run(self) -> None:
        return None  # its measured acceptance is the guide

    def available(self, limit: int) -> int:
        """It can draft up to ``limit`` unless it lags too far behind to draft this round."""
        return limit if len(self.context) - self.blocks.committed <= self.max_query else 0

    def propose(self, max_tokens: int) -> list[int]:
        self.tokens, self.probs = [], []  # a new round: drafted only once chosen (DraftModel.run)
        return []

    def push(self, logits: torch.Tensor, sampler) -> None:
        """Take the next draft token from the draft's logits [V]: argmax, or drawn from q."""
        if sampler is None:
            self.tokens.append(int(logits.argmax()))
            return
        q = target_probs(logits.unsqueeze(0), sampler.temperature, sampler.top_k, sampler.top_p)[0]  # [V]
        noise = torch.empty_like(q).exponential_(generator=self.generator)  # [V]
        score = torch.where(q > 0, q / noise, torch.full_like(q, -1.0))
        self.tokens.append(int(score.argmax()))  # drawn with probability q (the exponential race)
        self.probs.append(q)

    def observe(self, output_ids: list[int], output_text: str) -> None:
        """Follow the output; after a round it drafted, keep the K/V of the drafts the output kept."""
        new = output_ids[len(self.context) - self.prompt_length:]
        if self.tokens:
            kept = common_prefix_length(self.tokens, new)
            # Its cache holds the pending token and all drafts but the last.
            self.blocks.committed = min(self.blocks.committed, len(self.context) + min(kept, len(self.tokens) - 1))
        self.context.extend(new)
        self.tokens, self.probs = [], []

    def close(self, completed: bool) -> None:
        self.drafter.release(self)
