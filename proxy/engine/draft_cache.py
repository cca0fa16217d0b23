"""Drafts that learn across requests: suffix trees over earlier outputs, kept per tenant scope.

SuffixDecoding (Oliaro et al., arXiv 2411.04975) drafts from two suffix trees: one over the
request's own prompt and output, one over the outputs of earlier requests. After the longest
match of the output's tail it follows the most frequent continuation, and it drafts no further
than the match is long (a deeper match earns a longer draft). The trees are arctic-inference's
``SuffixDecodingCache`` (C++, the implementation vLLM's ``suffix`` method uses); this module adds
what a shared proxy needs around it:

- **scopes**: one cache per tenant scope (the server names them: an API key, a ``user``, or one
  shared scope), so one tenant's outputs never shape another tenant's drafts;
- **bounds**: the cached outputs of all scopes together are held to ``max_tokens`` tokens and
  ``max_requests`` requests, the oldest evicted first;
- **nothing half-inserted**: an output joins its scope's tree as it is produced (concurrent
  requests of a tenant draft from each other), and a request that does not complete (cancelled,
  failed) is taken out again when it closes.

Callers use ``DraftCache.source(scope, prompt_ids)`` for a request's ``SuffixCacheSource`` and
must ``close`` it when the request ends (``Speculation.close`` does).
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict

from foretell.proxy.options import DRAFT_CACHE_TOKENS

# The trees' depth: the longest context match and so the longest draft (vLLM's default is 24;
# 32 lets a copied block run a little further per pass at the same per-token cost order).
MAX_DEPTH = 32
# Cached output tokens of all scopes together, and cached requests.
DEFAULT_MAX_TOKENS = DRAFT_CACHE_TOKENS
DEFAULT_MAX_REQUESTS = 10_000
# Continuation tokens less likely than this (by frequency after the match) end a draft.
MIN_TOKEN_PROB = 0.1


def suffix_cache_class():
    """arctic-inference's cache class; ImportError with the fix when it is not installed."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as error:
        raise ImportError("the draft cache needs arctic-inference: scripts/setup.sh builds it against "
                          "the installed torch (see the README's set-up paragraph)") from error
    return SuffixDecodingCache


class DraftCache:
    """Suffix trees of earlier outputs, per scope, bounded in tokens and requests."""

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS, max_requests: int = DEFAULT_MAX_REQUESTS,
                 max_depth: int = MAX_DEPTH):
        if max_tokens < 1 or max_requests < 1 or max_depth < 1:
            raise ValueError("max_tokens, max_requests and max_depth must be at least 1")
        self._cache_class = suffix_cache_class()
        self.max_tokens, self.max_requests, self.max_depth = max_tokens, max_requests, max_depth
        self._scopes: dict[str, object] = {}  # scope -> its SuffixDecodingCache
        self._scope_of: dict[int, str] = {}  # request -> scope, for open and cached requests
        self._open: set[int] = set()
        self._cached: OrderedDict[int, int] = OrderedDict()  # request -> cached output tokens, oldest first
        self.tokens = 0  # cached output tokens, all scopes
        self._ids = itertools.count()
        self._lock = threading.Lock()  # the engine's worker writes; metrics read from elsewhere

    def source(self, scope: str, prompt_ids: list[int]) -> "SuffixCacheSource":
        """A request's draft source: its own prompt and output, and its scope's earlier outputs."""
        return SuffixCacheSource(self, scope, prompt_ids)

    # ---- what a source does ---------------------------------------------------------------

    def _open_request(self, scope: str, prompt_ids: list[int]) -> int:
        with self._lock:
            request = next(self._ids)
            cache = self._scopes.get(scope)
            if cache is None:
                cache = self._scopes[scope] = self._cache_class(self.max_depth, max_cached_requests=-1)
            cache.start_request(request, prompt_ids)
            self._scope_of[request] = scope
            self._open.add(request)
            self._cached[request] = 0
            self._evict()
            return request

    def _extend(self, request: int, tokens: list[int]) -> None:
        with self._lock:
            self._scopes[self._scope_of[request]].add_active_response(request, tokens)
            if request in self._cached:
                self._cached[request] += len(tokens)
                self.tokens += len(tokens)
                self._evict()

    def _speculate(self, request: int, context: list[int], limit: int) -> list[int]:
        with self._lock:
            draft = self._scopes[self._scope_of[request]].speculate(
                request, context, max_spec_tokens=limit, max_spec_factor=1.0, min_token_prob=MIN_TOKEN_PROB)
            return list(draft.token_ids[:limit])

    def _close_request(self, request: int, keep: bool) -> None:
        """End a request; ``keep``: its output stays cached (it completed), else it is removed."""
        with self._lock:
            if request not in self._open:
                return
            self._open.discard(request)
            self._scopes[self._scope_of[request]].stop_request(request)
            if not keep and request in self._cached:
                self._drop(request)
            elif request not in self._cached:
                self._forget(request)

    def _evict(self) -> None:
        """Oldest cached outputs out until the bounds hold."""
        while self._cached and (self.tokens > self.max_tokens or len(self._cached) > self.max_requests):
            self._drop(next(iter(self._cached)))

    def _drop(self, request: int) -> None:
        self.tokens -= self._cached.pop(request)
        self._scopes[self._scope_of[request]].evict_cached_response(request)
        if request not in self._open:
            self._forget(request)

    def _forget(self, request: int) -> None:
        scope = self._scope_of.pop(request)
        cache = self._scopes[scope]
        if not cache.active_requests and not cache.cached_requests:
            del self._scopes[scope]  # an empty scope holds no tree

    # ---- what it holds ----------------------------------------------------------------------

    def snapshot(self) -> dict:
        """Sizes for metrics and tests: scopes, open requests, cached requests and tokens."""
        with self._lock:
            return {"scopes": len(self._scopes), "open_requests": len(self._open),
                    "cached_requests": len(self._cached), "cached_tokens": self.tokens}

    def cached_requests(self, scope: str) -> int:
        with self._lock:
            cache = self._scopes.get(scope)
            return len(cache.cached_requests) if cache is not None else 0


class SuffixCacheSource:
    """A request's drafts from its own prompt and output and its scope's earlier outputs (the
    draft source interface of ``draft_sources.py``, plus ``close``)."""

    name = "suffix_cache"
    scores_on_text = False

    def __init__(self, cache: DraftCache, scope: str, prompt_ids: list[int]):
        self.cache = cache
        self.scope = scope
        self.request = cache._open_request(scope, list(prompt_ids))
        self.context = list(prompt_ids[-cache.max_depth:])  # the tail a match is sought for
        self.observed = 0  # output tokens handed to the cache
        self.closed = False

    def agreement_run(self) -> None:
        return None  # the draft is already cut to the match; the running estimate does the rest

    def propose(self, max_tokens: int) -> list[int]:
        if max_tokens <= 0 or self.closed:
            return []
        return self.cache._speculate(self.request, self.context, max_tokens)

    def observe(self, output_ids: list[int], output_text: str) -> None:
        new = output_ids[self.observed:]
        if not new or self.closed:
            return
        self.observed = len(output_ids)
        self.cache._extend(self.request, list(new))
        self.context = (self.context + list(new))[-self.cache.max_depth:]

    def close(self, completed: bool) -> None:
        """The request ended: a completed output stays for later requests of the scope, any other
        is taken out whole."""
        if not self.closed:
            self.closed = True
            self.cache._close_request(self.request, keep=completed)
