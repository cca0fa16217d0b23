"""foretell.proxy.engine: the local speculative engine.

Sequences (``sequence.py``), the batched step (``engine.py``), the paged KV cache
(``kv_cache.py``) and the scheduler that feeds it (``scheduler.py``); draft sources and how much
to draft, sampling, detokenisation. It never imports the HTTP server.
"""

from foretell.proxy.engine.precision import import_torchao_quietly

import_torchao_quietly()  # before transformers imports it, loudly

from foretell.proxy.engine.engine import (  # noqa: E402
    CacheFullError,
    GenerationRequest,
    GenerationResult,
    GenerationStats,
    Sequence,
    SequenceUpdate,
    SpeculativeEngine,
    TokenLogprob,
)

__all__ = ["CacheFullError", "GenerationRequest", "GenerationResult", "GenerationStats", "Sequence",
           "SequenceUpdate", "SpeculativeEngine", "TokenLogprob"]
