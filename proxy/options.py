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
