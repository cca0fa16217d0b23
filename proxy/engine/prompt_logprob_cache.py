"""Prompt log-probabilities already computed, reused by a later prompt that starts the same way.

A prompt-logprobs request (OpenAI's legacy ``echo`` with ``logprobs``) needs the output head over
every prompt position, which on a 262k vocabulary costs more than the transformer itself, and a
cached KV prefix has no logits. The entry of prompt token ``i`` depends only on tokens ``0..i``,
so the entries of a prompt that shares its first ``L`` tokens with an earlier one are the earlier
entries ``1..L-1``. Two users repeat long prefixes: remote verification (every verify re-sends the
context with a longer draft) and loglikelihood evaluation (one context, many continuations).

Entries computed in another pass shape may differ from a fresh computation in the last bits, as
any batching does.
"""

from __future__ import annotations

from collections import OrderedDict

from foretell.proxy.engine.draft_sources import common_prefix_length
from foretell.proxy.engine.sequence import TokenLogprob
from foretell.proxy.options import KV_CACHE_TOKENS

DEFAULT_MAX_POSITIONS = KV_CACHE_TOKENS


class PromptLogprobCache:
    """Least recently used prompts with their entries (``entries[j]`` is prompt token ``j + 1``'s),
    bounded by the positions held in all."""

    def __init__(self, max_positions: int = DEFAULT_MAX_POSITIONS):
        self.max_positions = max_positions
        self.prompts: OrderedDict[tuple[int, ...], tuple[int, list[TokenLogprob]]] = OrderedDict()
        self.positions = 0

    def lookup(self, prompt: list[int], top: int) -> list[TokenLogprob]:
        """The known entries of ``prompt``'s first tokens (at most ``len(prompt) - 1``), with at
        most ``top`` alternatives each; empty when no cached prompt starts the same way with at
        least ``top`` alternatives."""
        best_key, best = None, 0
        for key, (cached_top, entries) in self.prompts.items():
            if cached_top < top:
                continue
            shared = common_prefix_length(key, prompt)  # a key is its entries' prompt: len(entries) + 1
            if shared > best:
                best_key, best = key, shared
        if best_key is None or best < 2:
            return []
        self.prompts.move_to_end(best_key)
        entries = self.prompts[best_key][1][: best - 1]
        return [TokenLogprob(e.token_id, e.logprob, e.top[:top]) for e in entries]

    def store(self, prompt: list[int], top: int, entries: list[TokenLogprob]) -> None:
        """Keep ``entries`` (prompt tokens 1..) of ``prompt``; the oldest prompts make room."""
        if len(entries) > self.max_positions:
            return
        key = tuple(prompt[: len(entries) + 1])
        old = self.prompts.pop(key, None)
        if old is not None:
            self.positions -= len(old[1])
            if old[0] > top:  # keep the richer one
                entries, top = old[1], old[0]
        self.prompts[key] = (top, list(entries))
        self.positions += len(entries)
        while self.positions > self.max_positions:
            _, (_, dropped) = self.prompts.popitem(last=False)
            self.positions -= len(dropped)
