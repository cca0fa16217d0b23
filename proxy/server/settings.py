"""The server's settings: what ``foretell serve`` was started with (``foretell/cli/serve.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from foretell.proxy.options import (DEFAULT_MAX_TOKENS, DRAFT_CACHE_SCOPE, DRAFT_CACHE_TOKENS, KV_CACHE_TOKENS, MAX_BODY_BYTES,
                                    MAX_PREDICTION_CHARS, MAX_QUEUE, MAX_RUNNING, PREFILL_CHUNK)
from foretell.proxy.server.upstream import RouteTable


@dataclass
class ServerSettings:
    model: str | None = None
    served_model_name: str | None = None
    api_keys: tuple[str, ...] = ()
    max_queue: int = MAX_QUEUE
    max_body_bytes: int = MAX_BODY_BYTES
    max_prediction_chars: int = MAX_PREDICTION_CHARS
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    calibrate: bool = True
    recalibrate: bool = False  # measure again even when a cached calibration exists
    # The engine's batching: KV cache capacity in tokens, prompt tokens prefilled per step,
    # sequences in flight at once.
    kv_cache_tokens: int = KV_CACHE_TOKENS
    prefill_chunk: int = PREFILL_CHUNK
    max_running: int = MAX_RUNNING
    routes: RouteTable = field(default_factory=RouteTable)
    # The address served; the Host header must name it (or loopback, or an allowed host).
    host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()  # further Host header values; "*" allows any
    metrics_public: bool = False  # /metrics without the API key
    # The local model's precision (proxy/engine/precision.py): --dtype, --quantize, --fp32-head.
    dtype: str = "auto"
    quantize: str = "auto"
    fp32_head: bool | None = None  # None: precision.default_fp32_head
    # Triton or the torch references for attention and verification (engine/kernel_choice.py).
    kernels: str | None = None  # None: FORETELL_KERNELS, else auto
    # The draft model (engine/draft_model.py): a path, self:int8 or self:int4; None: none.
    draft_model: str | None = None
    # The draft cache of earlier answers: whose answers a request drafts from (draft_scope.py:
    # key, user, global or off) and how many output tokens it holds, all scopes together.
    draft_cache_scope: str = DRAFT_CACHE_SCOPE
    draft_cache_tokens: int = DRAFT_CACHE_TOKENS
    # Build the grammar engine's vocabulary table while loading (seconds, holding the GIL) rather
    # than at the first request with a response_format or a required or strict tool call.
    grammar_warmup: bool = True
