"""Names of the local model's precision, kernel and draft-cache options, shared by the command line, the configuration
file and the engine (``engine/precision.py``). Importable without torch, as the command line
and the routing configuration are."""

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
QUANTIZE_CHOICES = ("auto", "none", "int8", "int4")
# Where a local route of the configuration file may set them, as on the command line.
PRECISION_KEYS = ("dtype", "quantize", "fp32_head")
# Which implementation runs the engine's kernels (``engine/kernel_choice.py``): --kernels.
KERNEL_CHOICES = ("auto", "triton", "reference")
# Whose earlier answers a request drafts from (``server/draft_scope.py``): --draft-cache-scope.
DRAFT_CACHE_SCOPES = ("key", "user", "global", "off")
# How ``foretell serve --replicas N`` places requests (``replicas/routing.py``): --routing.
REPLICA_ROUTINGS = ("affinity", "round-robin")

# The engine's and the server's sizes, written once: the command line's defaults, the server's
# settings and the engine's constructor read them here.
KV_CACHE_TOKENS = 65536  # --kv-cache-tokens: the KV cache's capacity (full-attention layers)
PREFILL_CHUNK = 256  # --prefill-chunk: prompt tokens prefilled per step
MAX_RUNNING = 16  # --max-running: sequences batched into each pass
MAX_QUEUE = 16  # --max-queue: requests waiting for the engine before 429
DRAFT_CACHE_TOKENS = 1_000_000  # --draft-cache-tokens: the draft cache's output tokens, all scopes
MAX_BODY_BYTES = 4 * 1024 * 1024  # --max-body-bytes: a larger request body is answered 413
MAX_PREDICTION_CHARS = 1024 * 1024  # --max-prediction-chars: a longer prediction is answered 413
DEFAULT_MAX_TOKENS = 512  # --default-max-tokens: a chat request's max_tokens when it sets none
