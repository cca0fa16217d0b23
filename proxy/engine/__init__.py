"""foretell.proxy.engine: the local speculative engine.

Sequences, the batched step, the KV cache and the scheduler that feeds it, the draft sources and
how much to draft, sampling, stopping and detokenisation. It never imports the HTTP server.
"""

from foretell.proxy.engine.engine import (
    GenerationRequest,
    GenerationResult,
    GenerationStats,
    SpeculativeEngine,
    TokenLogprob,
    new_cache,
    prefill,
    verify_draft,
)

__all__ = ["GenerationRequest", "GenerationResult", "GenerationStats", "SpeculativeEngine",
           "TokenLogprob", "new_cache", "prefill", "verify_draft"]
