"""Constrained decoding: an output held to a grammar (any JSON object, or a JSON schema) at every
position the engine verifies, by llguidance's token masks.

Why llguidance: a maintained Rust engine (the one behind vLLM's and SGLang's ``guidance``
backend) shipped as one CPU wheel without dependencies, that computes a position's mask over a
262k vocabulary in well under a millisecond and can roll back, which speculation needs. xgrammar
would do as well; it brings a larger build and a CUDA-first stack.

Exactness under speculation. A draft of ``k`` tokens is verified on ``k + 1`` rows; row ``i``
is masked to the tokens the grammar allows after the output and the first ``i`` draft tokens.
The masked argmax (greedy) or the masked, renormalised distribution (sampling) at each row is then
what plain constrained decoding computes at that position, so the accepted tokens, the recovered
token and the bonus are plain constrained decoding's. A draft token the grammar forbids has a
masked score of -inf: it would be rejected at its position, so the draft is cut before it
(``allowed``) and no position is spent on it.

The masks of a step are computed on a worker thread while the pass runs (``MaskJob``): they
depend only on the drafts, which are chosen before the pass, and llguidance releases the GIL
while it computes them.
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

# llguidance tables by tokenizer, then by (vocabulary size, EOS ids). Weak keys: a table goes with
# its tokenizer, and a new tokenizer never gets an old one's table (as it could by a reused id).
_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()


def grammar_tokenizer(tokenizer, vocab_size: int, eos_ids: frozenset[int]):
    """llguidance's view of ``tokenizer`` (a Hugging Face fast tokenizer), ending on any of
    ``eos_ids``. Building one reads the whole vocabulary (seconds at 262k tokens): cached, and
    built off the engine's thread (the server does it beside the prompt)."""
    import llguidance.hf

    with _TOKENIZERS_LOCK:
        tables = _TOKENIZERS.setdefault(tokenizer, {})
        if (vocab_size, eos_ids) not in tables:
            backend = getattr(tokenizer, "backend_tokenizer", None)
            if backend is None:
                raise ValueError("structured output needs a fast (Rust) tokenizer; this model's is not one")
            tables[vocab_size, eos_ids] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                                       eos_token=sorted(eos_ids))
        return tables[vocab_size, eos_ids]


def json_grammar(schema: dict | None) -> str:
    """The llguidance grammar of any JSON object (``schema`` None: OpenAI's JSON mode) or of a
    JSON schema."""
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_json_schema({"type": "object"} if schema is None else schema)


class Grammar:
    """One sequence's place in its grammar: what it allows next, after a draft, and as the
    output grows."""

    def __init__(self, tokenizer, grammar: str, vocab_size: int):
        """``tokenizer``: ``grammar_tokenizer``'s; ValueError for a grammar llguidance refuses."""
        from llguidance import LLMatcher

        self.vocab_size = vocab_size
        self.eos_ids = frozenset(tokenizer.eos_tokens)
        self.matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"the grammar is not valid: {self.matcher.get_error()}")

    def copy(self) -> "Grammar":
        """An independent copy in the same state (each of ``n`` choices runs its own)."""
        twin = object.__new__(Grammar)
        twin.vocab_size, twin.eos_ids, twin.matcher = self.vocab_size, self.eos_ids, self.matcher.deep_copy()
        return twin

    def allowed(self, draft: list[int]) -> int:
        """How many of ``draft``'s leading tokens the grammar allows from here."""
        return self.matcher.validate_tokens(list(draft)) if draft else 0

    def masks(self, draft: list[int]) -> torch.Tensor:
        """The tokens allowed at each of the ``len(draft) + 1`` rows verifying ``draft`` (every
        draft token allowed: ``allowed``), as a bool tensor [k+1, V]; the state is unchanged."""
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

        rows = len(draft) + 1
        bitmask = allocate_token_bitmask(rows, self.vocab_size)  # [k+1, ceil(V/32)] int32, all allowed
        consumed = 0
        for i in range(rows):
            fill_next_token_bitmask(self.matcher, bitmask, i)
            if i == len(draft):
                break
            if draft[i] in self.eos_ids:
                # The output ends there: the rows after it are never read, and keep "all allowed"
                # (no row without mass). Not consumed: llguidance's rollback does not count an
                # EOS, so rolling it back would undo one token too many.
                break
            if not self.matcher.consume_token(draft[i]):
                raise ValueError("a draft token the grammar had allowed was refused")
            consumed += 1
        self.matcher.rollback(consumed)
        # Bit j of word w is token 32 w + j (little-endian words).
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")  # [k+1, 32 words]
        return torch.from_numpy(bits[:, :self.vocab_size].astype(bool))  # [k+1, V]

    def advance(self, tokens: list[int]) -> None:
        """The output grew by ``tokens`` (verified under this grammar's masks)."""
        for token in tokens:  # one by one: consume_tokens refuses the EOS that ends a stopped grammar
            if not self.matcher.consume_token(token):
                raise ValueError(f"the output left its grammar: {self.matcher.get_error()}")


def mask_rows(rows: torch.Tensor, allowed: torch.Tensor) -> None:
    """Forbid in ``rows`` [k+1, V'] every token ``allowed`` [k+1, V] does not hold (and any
    logit column past the grammar's vocabulary), in place."""
    width = allowed.shape[1]
    if rows.shape[1] > width:
        rows[:, width:] = float("-inf")
    rows[:, :width].masked_fill_(~allowed.to(rows.device), float("-inf"))


class MaskJob:
    """A step's masks, computed on one worker thread while the pass runs: ``start`` before the
    pass, ``wait`` after it."""

    _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="foretell-grammar")

    def __init__(self):
        self.futures: list[tuple[object, Future]] = []

    def start(self, key, grammar: Grammar, draft: list[int]) -> None:
        self.futures.append((key, self._pool.submit(grammar.masks, list(draft))))

    def wait(self) -> dict:
        """{key: allowed [k+1, V] or the exception computing it raised}."""
        done = {}
        for key, future in self.futures:
            try:
                done[key] = future.result()
            except Exception as error:  # that sequence fails, the others go on
                done[key] = error
        return done
