"""Every option of ``foretell serve`` and ``foretell generate``, written once: its name, kind,
default, environment variable and help. The command line builds its parser from this table
(``foretell/cli/arguments.py: add_option``), a local route of the configuration file takes the
entries marked ``in_config`` (``server/upstream.py``), and the server's settings and the engine's
constructor take their defaults from the constants below. Importable without torch, as the
command line and the routing configuration are."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
QUANTIZE_CHOICES = ("auto", "none", "int8", "int4")
# Which implementation runs the engine's kernels (``engine/kernel_choice.py``).
KERNEL_CHOICES = ("auto", "triton", "reference")
# Whose earlier answers a request drafts from (``server/draft_scope.py``).
DRAFT_CACHE_SCOPES = ("key", "user", "global", "off")
# How ``foretell serve --replicas N`` places requests (``replicas/routing.py``).
REPLICA_ROUTINGS = ("affinity", "round-robin")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")

# The engine's and the server's sizes: the command line's defaults, the server's settings and
# the engine's constructor read them here.
KV_CACHE_TOKENS = 65536  # the KV cache's capacity (full-attention layers)
PREFILL_CHUNK = 256  # prompt tokens prefilled per step
MAX_RUNNING = 16  # sequences batched into each pass
MAX_QUEUE = 16  # requests waiting for the engine before 429
DRAFT_CACHE_TOKENS = 1_000_000  # the draft cache's output tokens, all scopes
MAX_BODY_BYTES = 4 * 1024 * 1024  # a larger request body is answered 413
MAX_PREDICTION_CHARS = 1024 * 1024  # a longer prediction is answered 413
DEFAULT_MAX_TOKENS = 512  # a chat request's max_tokens when it sets none
DRAFT_CACHE_SCOPE = "key"


@dataclass(frozen=True)
class Option:
    """One option. ``kind``: text, int, positive_int, non_negative_float, choice (of
    ``choices``), flag (on when given), switch (``--x`` / ``--no-x``, None when neither) or
    keys (repeatable; the variable comma-separated). A default of None means "decided later"
    (the configuration file's local route, then the engine's own choice)."""

    name: str  # the settings field; --name-with-dashes on the command line
    kind: str
    default: Any
    env: str
    help: str
    choices: tuple = ()
    metavar: str | None = None
    env_form: str = ""  # how the variable is written, where it is not just a value ("=1")
    in_config: bool = False  # a local route of --config may set it too
    negative_help: str = ""  # a switch's --no-x

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def full_help(self) -> str:
        return f"{self.help} (env: {self.env}{self.env_form})"


def _options(*options: Option) -> dict[str, Option]:
    return {option.name: option for option in options}


# What `serve` listens on, whom it lets in, where its routes come from.
SERVER_OPTIONS = _options(
    Option("model", "text", None, "FORETELL_MODEL", metavar="M",
           help="'gemma-3-270m' (default), a .gguf file or a Hugging Face model folder"),
    Option("served_model_name", "text", None, "FORETELL_SERVED_MODEL_NAME", metavar="NAME",
           help="the name clients use for the local model (default: gemma-3-270m for the embedded "
                "model, else the folder or file name)"),
    Option("host", "text", "127.0.0.1", "FORETELL_HOST", help="address to listen on (default: 127.0.0.1)"),
    Option("allowed_hosts", "text", "", "FORETELL_ALLOWED_HOSTS", metavar="HOSTS",
           help="comma-separated Host header values accepted besides 127.0.0.1, localhost, [::1] and "
                "--host ('name' for any port, 'name:port', '*' for any host); other hosts get 421, so "
                "that a web page cannot reach the server through a domain rebound to it"),
    Option("port", "int", 8000, "FORETELL_PORT", help="port (default: 8000)"),
    Option("config", "text", None, "FORETELL_CONFIG", metavar="FILE",
           help="TOML file of routes and upstreams, see examples/foretell.toml"),
    Option("api_key", "keys", (), "FORETELL_API_KEY", metavar="KEY", env_form=", comma-separated",
           help="require 'Authorization: Bearer KEY' on /v1/*; repeatable"),
    Option("metrics_public", "flag", False, "FORETELL_METRICS_PUBLIC", env_form="=1",
           help="serve /metrics without the API key (default: /metrics needs the key when --api-key is set)"),
)

# The local engine: its sizes, the request limits, the draft cache, precision and kernels.
ENGINE_OPTIONS = _options(
    Option("max_queue", "positive_int", MAX_QUEUE, "FORETELL_MAX_QUEUE",
           help=f"requests waiting for the engine before 429 (default: {MAX_QUEUE})"),
    Option("max_running", "positive_int", MAX_RUNNING, "FORETELL_MAX_RUNNING",
           help=f"requests batched into each target pass at once; more wait in the queue (default: {MAX_RUNNING})"),
    Option("kv_cache_tokens", "positive_int", KV_CACHE_TOKENS, "FORETELL_KV_CACHE_TOKENS",
           help="KV cache capacity in tokens (full-attention layers; sliding-window layers keep only "
                f"their window); a request that can never fit is refused with 400 (default: {KV_CACHE_TOKENS})"),
    Option("prefill_chunk", "positive_int", PREFILL_CHUNK, "FORETELL_PREFILL_CHUNK",
           help="prompt tokens prefilled per step, so a long prompt stalls running streams by one chunk "
                f"at most (default: {PREFILL_CHUNK})"),
    Option("draft_cache_scope", "choice", DRAFT_CACHE_SCOPE, "FORETELL_DRAFT_CACHE_SCOPE", choices=DRAFT_CACHE_SCOPES,
           help="drafts from earlier answers (a suffix-tree cache, beside predictions and prompt lookup), "
                "kept apart per tenant: key (default: per API key where --api-key is set, else per request "
                "'user', else one shared cache), user (per 'user' within each key), global (one cache for "
                "all: acceptance, and so latency, then depends on what others asked) or off. A request opts "
                "out with speculation: {\"draft_cache\": false}"),
    Option("draft_cache_tokens", "positive_int", DRAFT_CACHE_TOKENS, "FORETELL_DRAFT_CACHE_TOKENS",
           help="output tokens the draft cache holds, all scopes together; the oldest answers go first "
                f"(default: {DRAFT_CACHE_TOKENS}, about 0.25 GB)"),
    Option("max_body_bytes", "positive_int", MAX_BODY_BYTES, "FORETELL_MAX_BODY_BYTES",
           help=f"largest request body, else 413 (default: {MAX_BODY_BYTES // 2**20} MiB)"),
    Option("max_prediction_chars", "positive_int", MAX_PREDICTION_CHARS, "FORETELL_MAX_PREDICTION_CHARS",
           help=f"largest prediction, else 413 (default: {MAX_PREDICTION_CHARS // 2**20} Mi characters)"),
    Option("default_max_tokens", "positive_int", DEFAULT_MAX_TOKENS, "FORETELL_DEFAULT_MAX_TOKENS",
           help=f"chat max_tokens when the request sets none (default: {DEFAULT_MAX_TOKENS}; completions "
                "default to 16 as OpenAI's)"),
)

# The precision, kernels and draft model of the commands that load the model (serve, generate).
# None: the configuration file's local route, else "auto" (no draft model).
PRECISION_OPTIONS = _options(
    Option("dtype", "choice", None, "FORETELL_DTYPE", choices=DTYPE_CHOICES, in_config=True,
           help="weights' dtype: auto (default: float32 beside --quantize auto's int8, else bfloat16 on "
                "CUDA and on a CPU with native bf16, else float32), float32 (text identical to plain greedy "
                "decoding but at near ties; with --quantize auto it keeps float32 throughout), bfloat16 (on a CPU "
                "with native bf16: one text per request, speculative text identical to its own plain text; "
                "elsewhere identical to it except at near ties) or float16 (except at near ties; see the README)"),
    Option("fp32_head", "switch", None, "FORETELL_FP32_HEAD", env_form="=1 or 0", in_config=True,
           help="score each row's leading tokens in float32 over an approximate head (bf16/fp16 or int8), "
                "so that rounding does not decide between them (default: on for int8, and for bf16/fp16 "
                "unquantized; with int4 it keeps the head in bf16)",
           negative_help="take the logits at the head's own precision"),
    Option("quantize", "choice", None, "FORETELL_QUANTIZE", choices=QUANTIZE_CHOICES, in_config=True,
           help="quantization of the linear layers: auto (default: int8 on a CPU where it measures faster "
                "than float32 on the output head, timed once per machine; none on CUDA or beside a --dtype "
                "given by name), none, int8 (int8 weights x int8 activations in exact integer sums through "
                "FBGEMM on x86: one text per request, speculative text identical to its own plain text; "
                "weight-only elsewhere) or int4 (torchao weight-only, groups of 128; identical to its own "
                "plain decoding except at near ties)"),
    Option("kernels", "choice", None, "FORETELL_KERNELS", choices=KERNEL_CHOICES,
           help="attention and verification kernels: auto (default: Triton on CUDA, each checked against "
                "its torch reference at start-up and replaced by it if it fails; the torch references "
                "elsewhere), triton (also on a CPU under TRITON_INTERPRET=1: slow, for tests) or reference"),
    Option("draft_model", "text", None, "FORETELL_DRAFT_MODEL", metavar="M", in_config=True,
           help="a draft model proposing tokens beside the other draft sources, weighed against them by its "
                "measured cost: a smaller model with the target's tokenizer (a .gguf file or a Hugging Face "
                "folder, loaded at the target's precision), or self:int8 / self:int4 (the target's own "
                "weights at that quantization). It drafts for requests without a prediction unless a "
                "request says otherwise (speculation: {\"draft_model\": true|false}); text is unchanged "
                "(default: none)"),
)
# What a local route of the configuration file may set, as on the command line.
PRECISION_KEYS = tuple(name for name, option in PRECISION_OPTIONS.items() if option.in_config)

# Start-up and logs.
RUN_OPTIONS = _options(
    Option("no_calibrate", "flag", False, "FORETELL_NO_CALIBRATE", env_form="=1",
           help="skip measuring the pass cost at start-up"),
    Option("no_grammar_warmup", "flag", False, "FORETELL_NO_GRAMMAR_WARMUP", env_form="=1",
           help="skip building the grammar engine's vocabulary table (response_format, required or strict "
                "tool calls) while the model loads, a few seconds at 262k tokens; the first request that "
                "needs it then builds it, and every running stream waits meanwhile"),
    Option("recalibrate", "flag", False, "FORETELL_RECALIBRATE", env_form="=1",
           help="measure the pass cost again instead of reusing this machine's cached calibration of the model"),
    Option("log_level", "choice", "info", "FORETELL_LOG_LEVEL", choices=LOG_LEVELS, metavar="LEVEL",
           help="debug, info (default), warning or error; info logs one foretell.access line per request"),
    Option("log_format", "choice", "text", "FORETELL_LOG_FORMAT", choices=LOG_FORMATS, metavar="FORMAT",
           help="text (default) or json (one object a line) on stderr"),
)

# `serve --replicas N` (Ray Serve).
REPLICA_OPTIONS = _options(
    Option("replicas", "positive_int", None, "FORETELL_REPLICAS", metavar="N",
           help="serve N engine replicas on Ray Serve (default: one engine, no Ray)"),
    Option("ray_address", "text", None, "FORETELL_RAY_ADDRESS", metavar="ADDR",
           help="join the Ray cluster at ADDR (auto, or the head's HOST:PORT that `ray start --head` prints) "
                "instead of starting a local Ray instance; on exit only this application is removed"),
    Option("routing", "choice", "affinity", "FORETELL_ROUTING", choices=REPLICA_ROUTINGS,
           help="affinity (default: prefix-cache affinity, shedding to the least busy replica when one is "
                "4 requests ahead) or round-robin"),
    Option("replica_cpus", "non_negative_float", None, "FORETELL_REPLICA_CPUS", metavar="C",
           help="CPUs reserved per replica (default: 1, or a fair share of a local instance's cores)"),
    Option("replica_gpus", "non_negative_float", None, "FORETELL_REPLICA_GPUS", metavar="G",
           help="GPUs per replica (default: 1 where the cluster has GPUs, else 0)"),
    Option("min_replicas", "positive_int", None, "FORETELL_MIN_REPLICAS", metavar="N",
           help="autoscale on ongoing requests (a replica's --max-running each), down to N replicas"),
    Option("max_replicas", "positive_int", None, "FORETELL_MAX_REPLICAS", metavar="N",
           help="autoscale up to N replicas"),
)
