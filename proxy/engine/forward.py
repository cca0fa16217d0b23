"""One forward pass of a model over a step's ragged batch, through its paged KV cache: the
target's pass in the engine, and the draft model's (``draft_model.py``).

``feeds`` are (a sequence's blocks, the tokens written after its committed length, the first of
those tokens whose logits are wanted or None); the tokens of every feed are flattened into one
``[1, T]`` batch, positions given explicitly, and only the wanted rows reach the output head.
"""

from __future__ import annotations

import contextlib

import torch

from foretell.proxy.engine.draft_length import PassCostModel
from foretell.proxy.engine.invariant_linear import Int8DynamicLinear
from foretell.proxy.engine.kv_cache import FULL, SLIDING, CacheFullError, PagedKVCache, SequenceBlocks
from foretell.proxy.engine.precision import head_rows, rescore_in_fp32

# Up to this many logit rows the output head is taken vocabulary-major (see ``_output_head``).
VOCABULARY_MAJOR_MAX_ROWS = 32


def forward_pass(model, cache: PagedKVCache, feeds: list[tuple[SequenceBlocks, list[int], int | None]],
                 fp32_head: bool = False) -> torch.Tensor:
    """One pass of ``model`` over ``feeds``; the wanted logits [rows, V] (float32), in feed order."""
    device = cache.device
    ids, positions, keep = [], [], []
    for blocks, tokens, logits_from in feeds:
        if logits_from is not None:
            keep.extend(range(len(ids) + logits_from, len(ids) + len(tokens)))
        ids.extend(tokens)
        positions.extend(range(blocks.committed, blocks.committed + len(tokens)))
    cache.plan([(blocks, len(tokens)) for blocks, tokens, _ in feeds])
    with cache.attached(model), _output_head(model, fp32_head):
        out = model(
            input_ids=torch.tensor([ids], device=device),  # [1, T]
            position_ids=torch.tensor([positions], device=device),  # [1, T]
            attention_mask={FULL: None, SLIDING: None},  # the paged attention masks itself
            cache=cache, use_cache=True,
            logits_to_keep=torch.tensor(keep, dtype=torch.long, device=device),
        )
    return out.logits[0]  # [rows, V]


def measure_pass_cost(model, cache: PagedKVCache, positions, context_tokens: int = 256,
                      fp32_head: bool = False) -> PassCostModel:
    """Time passes of each of ``positions`` new positions (logits for all of them) after a random
    context of ``context_tokens``, and fit the line (``PassCostModel.measure``)."""
    blocks = cache.reserve(context_tokens + max(positions) + 1, max(context_tokens, max(positions)))
    if blocks is None:
        raise CacheFullError("the KV cache is too small to calibrate")
    vocab = min(1000, model.config.vocab_size)
    try:
        prompt = torch.randint(min(10, vocab - 1), vocab, (context_tokens,)).tolist()
        forward_pass(model, cache, [(blocks, prompt, None)], fp32_head)
        blocks.committed = context_tokens

        def forward(n: int) -> None:  # written after the context, never committed
            forward_pass(model, cache, [(blocks, torch.randint(0, vocab, (n,)).tolist(), 0)], fp32_head)
            if cache.device.type == "cuda":
                torch.cuda.synchronize()

        return PassCostModel.measure(forward, positions=positions)
    finally:
        cache.free(blocks)


@contextlib.contextmanager
def _output_head(model, fp32_head: bool):
    """Compute the output head for one pass, always returning float32 logits.

    - fp32 weights, a few rows: the product is taken vocabulary-major (``weight @ hidden.T``).
      With a 262k vocabulary the head is most of a pass on a CPU, and for a few rows (a batch
      of decoding sequences, a short draft) the BLAS library's kernel for ``hidden @ weight.T``
      is up to twice as slow as the same product taken vocabulary-major
      (``benchmarks/pass_cost.py``); from a few dozen rows on the two are alike, and the usual
      kernel is kept. One row gives the same floats either way; a few rows may differ in the
      last bits, as any change of batch shape does. (In bf16 the usual kernel is faster.)
    - a bf16/fp16 head with ``fp32_head``: the head runs at its own precision and the tokens
      that could win each row are scored again in float32 (``rescore_in_fp32``), from its
      weight rows (an unquantized or int8 head).
    - an int8 x int8 head (``invariant_linear.py``) with ``fp32_head``: the same, within the proven
      bound of its integer product (weights' and activations' rounding both).
    - anything else: the head's own forward, upcast."""
    head = model.get_output_embeddings()
    if head is None:
        yield
        return
    plain = type(head) is torch.nn.Linear and type(head.weight) is torch.nn.Parameter
    rows_of = head_rows(head) if fp32_head else None

    def forward(hidden: torch.Tensor) -> torch.Tensor:  # [..., d] -> [..., V]
        rows = hidden.reshape(-1, hidden.shape[-1])  # [n, d]
        if isinstance(head, Int8DynamicLinear):
            logits = head.product(rows)  # [n, V] float32
            if rows_of is not None:
                logits = rescore_in_fp32(rows, rows_of, head.bias, logits,
                                         head.error_bound(rows, head.last_residual_norm))
        elif plain and head.weight.dtype == torch.float32 and 1 < rows.shape[0] <= VOCABULARY_MAJOR_MAX_ROWS:
            logits = (head.weight @ rows.t()).t().contiguous()  # [V, n] -> [n, V]
            if head.bias is not None:
                logits = logits + head.bias
        else:
            logits = type(head).forward(head, rows)  # [n, V]
            if rows_of is not None and logits.dtype in (torch.bfloat16, torch.float16):
                logits = rescore_in_fp32(rows, rows_of, head.bias, logits)
        return logits.float().reshape(*hidden.shape[:-1], logits.shape[-1])

    head.forward = forward
    try:
        yield
    finally:
        del head.forward  # the class's own forward again
