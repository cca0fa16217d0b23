"""The ``foretell`` command line.

    foretell generate --prompt-file P [--prediction-file F] [--prompt-lookup] [--max-tokens N]
    foretell serve [--model M] [--host H] [--port P] [--config FILE] [--api-key KEY] [--allowed-hosts HOSTS]
    foretell edit FILE --instruction TEXT [--model M] [--base-url URL] [--write | --diff]

``generate`` prints the completion to stdout as it is verified and the statistics to stderr;
``serve`` runs the OpenAI-compatible proxy; ``edit`` edits a file through the proxy or any
OpenAI-compatible server, the file as the prediction (only ``foretell.sdk`` is imported: no torch).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from foretell import __version__
from foretell.origin_colors import CHOICES, legend, paint_spans, paint_within, use_color
from foretell.proxy.options import (DRAFT_CACHE_SCOPES, DRAFT_CACHE_TOKENS, DTYPE_CHOICES, KERNEL_CHOICES,
                                    KV_CACHE_TOKENS, MAX_QUEUE, MAX_RUNNING, PREFILL_CHUNK, QUANTIZE_CHOICES,
                                    REPLICA_ROUTINGS)


def _read_file(path: str, what: str) -> tuple[bytes, str]:
    """A file's bytes and its UTF-8 text, or a clear exit."""
    file = Path(path)
    if not file.is_file():
        raise SystemExit(f"foretell: {what} {path!r} does not exist or is not a file")
    raw = file.read_bytes()
    try:
        return raw, raw.decode("utf-8")
    except UnicodeDecodeError:
        raise SystemExit(f"foretell: {what} {path!r} is not valid UTF-8 text") from None


def _read_text(path: str, what: str) -> str:
    if path == "-":
        return sys.stdin.read()
    return _read_file(path, what)[1]


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


def _temperature(value: str) -> float:
    number = float(value)
    if not 0.0 <= number <= 2.0:
        raise argparse.ArgumentTypeError(f"must lie in [0, 2], got {value}")
    return number


def _top_p(value: str) -> float:
    number = float(value)
    if not 0.0 < number <= 1.0:
        raise argparse.ArgumentTypeError(f"must lie in (0, 1], got {value}")
    return number


def _log_level(value: str) -> str:
    level = value.strip().lower()
    if level not in ("debug", "info", "warning", "error"):
        raise argparse.ArgumentTypeError(f"must be debug, info, warning or error, got {value}")
    return level


def _log_format(value: str) -> str:
    fmt = value.strip().lower()
    if fmt not in ("text", "json"):
        raise argparse.ArgumentTypeError(f"must be text or json, got {value}")
    return fmt


def _choice(choices: tuple[str, ...]) -> Callable[[str], str]:
    def convert(value: str) -> str:
        name = value.strip().lower()
        if name not in choices:
            raise argparse.ArgumentTypeError(f"must be {', '.join(choices[:-1])} or {choices[-1]}, got {value}")
        return name
    return convert


def _switch(value: str) -> bool:
    name = value.strip().lower()
    if name not in ("1", "0", "true", "false", "on", "off", "yes", "no"):
        raise argparse.ArgumentTypeError(f"must be 1 or 0 (on or off), got {value}")
    return name in ("1", "true", "on", "yes")


def _add_precision_options(command: argparse.ArgumentParser) -> None:
    """--dtype, --fp32-head / --no-fp32-head and --quantize, the same on generate and serve.
    Each is None when neither the command line nor the environment sets it (serve then takes
    the configuration file's local route, else the default)."""
    command.add_argument("--dtype", type=_choice(DTYPE_CHOICES),
                         default=_FromEnv("FORETELL_DTYPE", None, _choice(DTYPE_CHOICES)),
                         help="weights' dtype: auto (default: float32 beside --quantize auto's int8, "
                              "else bfloat16 on CUDA and on a CPU with native bf16, else float32), "
                              "float32 (text identical to plain greedy decoding but at near ties; "
                              "with --quantize auto it keeps float32 throughout), bfloat16 or "
                              "float16 (identical to this engine's own plain decoding except at near "
                              "ties; see the README) (env: FORETELL_DTYPE)")
    head = command.add_mutually_exclusive_group()
    head.add_argument("--fp32-head", dest="fp32_head", action="store_true",
                      default=_FromEnv("FORETELL_FP32_HEAD", None, _switch),
                      help="score each row's leading tokens in float32 over an approximate head "
                           "(bf16/fp16 or int8), so that rounding does not decide between them "
                           "(default: on for int8, and for bf16/fp16 unquantized; with int4 it keeps "
                           "the head in bf16) (env: FORETELL_FP32_HEAD=1 or 0)")
    head.add_argument("--no-fp32-head", dest="fp32_head", action="store_false",
                      help="take the logits at the head's own precision")
    command.add_argument("--quantize", type=_choice(QUANTIZE_CHOICES),
                         default=_FromEnv("FORETELL_QUANTIZE", None, _choice(QUANTIZE_CHOICES)),
                         help="quantization of the linear layers: auto (default: int8 on a CPU where "
                              "it measures faster than float32 on the output head, timed once per "
                              "machine; none on CUDA or beside a --dtype given by name), none, int8 "
                              "(int8 weights x int8 activations in exact integer sums through FBGEMM "
                              "on x86: one text per request, speculative text identical to its own "
                              "plain text; weight-only elsewhere) or int4 (torchao weight-only, "
                              "groups of 128; identical to its own plain decoding except at near "
                              "ties) (env: FORETELL_QUANTIZE)")


def _add_kernels_option(command: argparse.ArgumentParser) -> None:
    command.add_argument("--kernels", type=_choice(KERNEL_CHOICES),
                         default=_FromEnv("FORETELL_KERNELS", None, _choice(KERNEL_CHOICES)),
                         help="attention and verification kernels: auto (default: Triton on CUDA, "
                              "each checked against its torch reference at start-up and replaced "
                              "by it if it fails; the torch references elsewhere), triton (also on "
                              "a CPU under TRITON_INTERPRET=1: slow, for tests) or reference "
                              "(env: FORETELL_KERNELS)")


def _seconds(value: str) -> float:
    number = float(value)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {value}")
    return number


# What a converter wants, for a value it refuses with a bare ValueError.
_EXPECTED = {int: "must be an integer", _positive_int: "must be a positive integer",
             float: "must be a number"}


class _FromEnv:
    """An option's default that comes from an environment variable, read after parsing (by
    ``_resolve_env``) rather than when the parser is built: a bad value then fails only the
    command that uses it (not ``--help``, not the other commands), and is reported by name."""

    def __init__(self, variable: str, fallback: Any, convert: Callable[[str], Any]):
        self.variable, self.fallback, self.convert = variable, fallback, convert

    def resolve(self) -> Any:
        raw = os.environ.get(self.variable, "")
        if not raw:
            return self.fallback
        try:
            return self.convert(raw)
        except argparse.ArgumentTypeError as error:
            reason = str(error)
        except ValueError:  # int() or float() refused it
            reason = _EXPECTED.get(self.convert, "is not a valid value")
        print(f"foretell: environment variable {self.variable}={raw!r}: {reason}", file=sys.stderr)
        raise SystemExit(2)  # as argparse exits for a bad option


def _resolve_env(args: argparse.Namespace) -> None:
    for name, value in vars(args).items():
        if isinstance(value, _FromEnv):
            setattr(args, name, value.resolve())


@contextlib.contextmanager
def _needs_proxy_extra(command: str):
    """A bare install (the SDK alone) has no torch, transformers, fastapi or uvicorn: say which
    install the command needs instead of a ModuleNotFoundError traceback."""
    try:
        yield
    except ModuleNotFoundError as error:
        if error.name and error.name.split(".")[0] == "foretell":
            raise  # one of our own modules: a bug, not an install
        what = f"missing module {error.name!r}" if error.name else str(error)
        raise SystemExit(f"foretell: `foretell {command}` needs the proxy extra ({what}): "
                         "pip install 'foretell[proxy]' (from a checkout: pip install -e '.[proxy]')"
                         ) from None


def _non_negative_float(value: str) -> float:
    number = float(value)
    if number < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return number


def _add_replica_options(command: argparse.ArgumentParser) -> None:
    env = os.environ.get
    group = command.add_argument_group(
        "replicas (Ray Serve; needs the ray extra: pip install 'foretell[ray]')",
        "Several engines behind one endpoint on the same --host/--port: an ingress routes each "
        "request to the replica holding its prompt's prefix in cache while load is even (else "
        "the least busy), retries a request whose replica died before answering, and answers "
        "/health and /metrics for all replicas.")
    group.add_argument("--replicas", type=_positive_int, metavar="N",
                       default=_FromEnv("FORETELL_REPLICAS", None, _positive_int),
                       help="serve N engine replicas on Ray Serve (default: one engine, no Ray) "
                            "(env: FORETELL_REPLICAS)")
    group.add_argument("--ray-address", metavar="ADDR", default=env("FORETELL_RAY_ADDRESS"),
                       help="join the Ray cluster at ADDR (auto, or the head's HOST:PORT that `ray start "
                            "--head` prints) instead of "
                            "starting a local Ray instance; on exit only this application is "
                            "removed (env: FORETELL_RAY_ADDRESS)")
    group.add_argument("--routing", type=_choice(REPLICA_ROUTINGS),
                       default=_FromEnv("FORETELL_ROUTING", "affinity", _choice(REPLICA_ROUTINGS)),
                       help="affinity (default: prefix-cache affinity, shedding to the least busy "
                            "replica when one is 4 requests ahead) or round-robin (env: FORETELL_ROUTING)")
    group.add_argument("--replica-cpus", type=_non_negative_float, metavar="C",
                       default=_FromEnv("FORETELL_REPLICA_CPUS", None, _non_negative_float),
                       help="CPUs reserved per replica (default: 1, or a fair share of a local "
                            "instance's cores) (env: FORETELL_REPLICA_CPUS)")
    group.add_argument("--replica-gpus", type=_non_negative_float, metavar="G",
                       default=_FromEnv("FORETELL_REPLICA_GPUS", None, _non_negative_float),
                       help="GPUs per replica (default: 1 where the cluster has GPUs, else 0) "
                            "(env: FORETELL_REPLICA_GPUS)")
    group.add_argument("--min-replicas", type=_positive_int, metavar="N",
                       default=_FromEnv("FORETELL_MIN_REPLICAS", None, _positive_int),
                       help="autoscale on ongoing requests (a replica's --max-running each), down "
                            "to N replicas (env: FORETELL_MIN_REPLICAS)")
    group.add_argument("--max-replicas", type=_positive_int, metavar="N",
                       default=_FromEnv("FORETELL_MAX_REPLICAS", None, _positive_int),
                       help="autoscale up to N replicas (env: FORETELL_MAX_REPLICAS)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="foretell",
        description="Predicted outputs for everyone: exact speculative decoding with predictions.",
    )
    parser.add_argument("--version", action="version", version=f"foretell {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    generate = commands.add_parser(
        "generate",
        help="complete a prompt on the local model, verifying a prediction and/or prompt lookup",
        description=(
            "Complete a prompt on the local model, greedily (default) or sampling with "
            "--temperature. Drafts from the prediction file and/or prompt lookup are verified "
            "many tokens per forward pass; the output is exactly what plain greedy decoding "
            "would produce (sampling: follows exactly plain sampling's distribution). The "
            "completion goes to stdout, the statistics to stderr."
        ),
    )
    generate.add_argument("--prompt-file", required=True, metavar="P",
                          help="file holding the prompt text ('-' reads stdin)")
    generate.add_argument("--prediction-file", metavar="F",
                          help="file holding the expected output, e.g. the file before an edit")
    lookup = generate.add_mutually_exclusive_group()
    lookup.add_argument("--prompt-lookup", action="store_true", default=None,
                        help="draft by copying n-grams from the prompt and the output so far "
                             "(default: on as the fallback when a prediction is given, else off)")
    lookup.add_argument("--no-prompt-lookup", dest="prompt_lookup", action="store_false",
                        help="never use prompt lookup, not even as the prediction's fallback")
    generate.add_argument("--max-tokens", type=_positive_int, default=256, metavar="N",
                          help="most tokens to generate (default: 256)")
    generate.add_argument("--stop", action="append", default=[], metavar="S",
                          help="stop before this string (repeatable)")
    generate.add_argument("--model", default=os.environ.get("FORETELL_MODEL"), metavar="M",
                          help="'gemma-3-270m' (embedded default), a .gguf file, or a local "
                               "Hugging Face model folder (env: FORETELL_MODEL)")
    generate.add_argument("--max-draft", type=_positive_int, default=128, metavar="K",
                          help="most draft tokens verified per forward pass (default: 128)")
    generate.add_argument("--temperature", type=_temperature, default=0.0, metavar="T",
                          help="0 (default) decodes greedily; > 0 samples, still speculating, with "
                               "exactly plain sampling's distribution")
    generate.add_argument("--top-p", type=_top_p, default=1.0, metavar="P",
                          help="sampling: keep the likeliest tokens up to this mass (default: 1)")
    generate.add_argument("--top-k", type=_positive_int, default=None, metavar="K",
                          help="sampling: keep the K likeliest tokens (default: all)")
    generate.add_argument("--seed", type=int, default=None,
                          help="sampling: the same seed gives the same text (default: a fresh "
                               "seed, printed with the statistics)")
    generate.add_argument("--no-calibrate", action="store_true",
                          help="skip measuring the pass cost at start-up (uses built-in figures)")
    generate.add_argument("--recalibrate", action="store_true",
                          help="measure the pass cost again instead of reusing this machine's cached "
                               "calibration of the model (under the foretell cache folder)")
    generate.add_argument("--color", choices=CHOICES, default="auto",
                          help="colour the text by token origin: green from the prediction, cyan "
                               "from prompt lookup, plain the model's own (default: auto, when stdout "
                               "is a terminal and NO_COLOR is unset)")
    generate.add_argument("--json-stats", action="store_true",
                          help="print the statistics to stderr as one JSON object")
    _add_precision_options(generate)
    _add_kernels_option(generate)

    env = os.environ.get
    serve = commands.add_parser(
        "serve",
        help="run the OpenAI-compatible proxy (local model with speculation, others upstream)",
        description=(
            "Serve an OpenAI-compatible API (POST /v1/completions, POST /v1/chat/completions, "
            "GET /v1/models, GET /health, GET /metrics; vLLM's POST /tokenize and POST /detokenize "
            "for the local model) and the playground page at GET /. The local model runs on the "
            "speculative engine; requests for other models go to the upstreams of --config or "
            "FORETELL_UPSTREAM_BASE_URL / FORETELL_UPSTREAM_API_KEY. Every option also reads "
            "the environment variable named in its help."
        ),
    )
    serve.add_argument("--model", default=env("FORETELL_MODEL"), metavar="M",
                       help="'gemma-3-270m' (default), a .gguf file or a Hugging Face model folder "
                            "(env: FORETELL_MODEL)")
    serve.add_argument("--served-model-name", default=env("FORETELL_SERVED_MODEL_NAME"), metavar="NAME",
                       help="the name clients use for the local model (default: gemma-3-270m for "
                            "the embedded model, else the folder or file name) "
                            "(env: FORETELL_SERVED_MODEL_NAME)")
    serve.add_argument("--host", default=env("FORETELL_HOST", "127.0.0.1"),
                       help="address to listen on (default: 127.0.0.1) (env: FORETELL_HOST)")
    serve.add_argument("--allowed-hosts", metavar="HOSTS", default=env("FORETELL_ALLOWED_HOSTS", ""),
                       help="comma-separated Host header values accepted besides 127.0.0.1, "
                            "localhost, [::1] and --host ('name' for any port, 'name:port', '*' for "
                            "any host); other hosts get 421, so that a web page cannot reach the "
                            "server through a domain rebound to it (env: FORETELL_ALLOWED_HOSTS)")
    serve.add_argument("--port", type=int, default=_FromEnv("FORETELL_PORT", 8000, int),
                       help="port (default: 8000) (env: FORETELL_PORT)")
    serve.add_argument("--config", default=env("FORETELL_CONFIG"), metavar="FILE",
                       help="TOML file of routes and upstreams, see examples/foretell.toml "
                            "(env: FORETELL_CONFIG)")
    serve.add_argument("--api-key", action="append", metavar="KEY",
                       default=[k for k in env("FORETELL_API_KEY", "").split(",") if k],
                       help="require 'Authorization: Bearer KEY' on /v1/*; repeatable "
                            "(env: FORETELL_API_KEY, comma-separated)")
    serve.add_argument("--metrics-public", action="store_true",
                       default=env("FORETELL_METRICS_PUBLIC", "") not in ("", "0"),
                       help="serve /metrics without the API key (default: /metrics needs the key "
                            "when --api-key is set) (env: FORETELL_METRICS_PUBLIC=1)")
    serve.add_argument("--max-queue", type=_positive_int,
                       default=_FromEnv("FORETELL_MAX_QUEUE", MAX_QUEUE, _positive_int),
                       help=f"requests waiting for the engine before 429 (default: {MAX_QUEUE}) "
                            "(env: FORETELL_MAX_QUEUE)")
    serve.add_argument("--max-running", type=_positive_int,
                       default=_FromEnv("FORETELL_MAX_RUNNING", MAX_RUNNING, _positive_int),
                       help="requests batched into each target pass at once; more wait in the queue "
                            f"(default: {MAX_RUNNING}) (env: FORETELL_MAX_RUNNING)")
    serve.add_argument("--kv-cache-tokens", type=_positive_int,
                       default=_FromEnv("FORETELL_KV_CACHE_TOKENS", KV_CACHE_TOKENS, _positive_int),
                       help="KV cache capacity in tokens (full-attention layers; sliding-window "
                            "layers keep only their window); a request that can never fit is "
                            f"refused with 400 (default: {KV_CACHE_TOKENS}) (env: FORETELL_KV_CACHE_TOKENS)")
    serve.add_argument("--prefill-chunk", type=_positive_int,
                       default=_FromEnv("FORETELL_PREFILL_CHUNK", PREFILL_CHUNK, _positive_int),
                       help="prompt tokens prefilled per step, so a long prompt stalls running "
                            f"streams by one chunk at most (default: {PREFILL_CHUNK}) (env: FORETELL_PREFILL_CHUNK)")
    serve.add_argument("--draft-cache-scope", type=_choice(DRAFT_CACHE_SCOPES),
                       default=_FromEnv("FORETELL_DRAFT_CACHE_SCOPE", "key", _choice(DRAFT_CACHE_SCOPES)),
                       help="drafts from earlier answers (a suffix-tree cache, beside predictions and "
                            "prompt lookup), kept apart per tenant: key (default: per API key where "
                            "--api-key is set, else per request 'user', else one shared cache), "
                            "user (per 'user' within each key), global (one cache for all: "
                            "acceptance, and so latency, then depends on what others asked) or off. "
                            "A request opts out with speculation: {\"draft_cache\": false} "
                            "(env: FORETELL_DRAFT_CACHE_SCOPE)")
    serve.add_argument("--draft-cache-tokens", type=_positive_int,
                       default=_FromEnv("FORETELL_DRAFT_CACHE_TOKENS", DRAFT_CACHE_TOKENS, _positive_int),
                       help="output tokens the draft cache holds, all scopes together; the oldest "
                            f"answers go first (default: {DRAFT_CACHE_TOKENS}, about 0.25 GB) "
                            "(env: FORETELL_DRAFT_CACHE_TOKENS)")
    serve.add_argument("--max-body-bytes", type=_positive_int,
                       default=_FromEnv("FORETELL_MAX_BODY_BYTES", 4 * 1024 * 1024, _positive_int),
                       help="largest request body, else 413 (default: 4 MiB) (env: FORETELL_MAX_BODY_BYTES)")
    serve.add_argument("--max-prediction-chars", type=_positive_int,
                       default=_FromEnv("FORETELL_MAX_PREDICTION_CHARS", 1024 * 1024, _positive_int),
                       help="largest prediction, else 413 (default: 1 Mi characters) "
                            "(env: FORETELL_MAX_PREDICTION_CHARS)")
    serve.add_argument("--default-max-tokens", type=_positive_int,
                       default=_FromEnv("FORETELL_DEFAULT_MAX_TOKENS", 512, _positive_int),
                       help="chat max_tokens when the request sets none (default: 512; completions "
                            "default to 16 as OpenAI's) (env: FORETELL_DEFAULT_MAX_TOKENS)")
    _add_precision_options(serve)
    _add_kernels_option(serve)
    serve.add_argument("--no-calibrate", action="store_true",
                       default=env("FORETELL_NO_CALIBRATE", "") not in ("", "0"),
                       help="skip measuring the pass cost at start-up (env: FORETELL_NO_CALIBRATE=1)")
    serve.add_argument("--recalibrate", action="store_true",
                       default=env("FORETELL_RECALIBRATE", "") not in ("", "0"),
                       help="measure the pass cost again instead of reusing this machine's cached "
                            "calibration of the model (env: FORETELL_RECALIBRATE=1)")
    serve.add_argument("--log-level", type=_log_level, metavar="LEVEL",
                       default=_FromEnv("FORETELL_LOG_LEVEL", "info", _log_level),
                       help="debug, info (default), warning or error; info logs one foretell.access "
                            "line per request (env: FORETELL_LOG_LEVEL)")
    serve.add_argument("--log-format", type=_log_format, metavar="FORMAT",
                       default=_FromEnv("FORETELL_LOG_FORMAT", "text", _log_format),
                       help="text (default) or json (one object a line) on stderr "
                            "(env: FORETELL_LOG_FORMAT)")
    _add_replica_options(serve)

    edit = commands.add_parser(
        "edit",
        help="edit a file through the proxy or any OpenAI-compatible server, the file as the prediction",
        description=(
            "Ask a model to apply an instruction to FILE, sending the file as the prediction. "
            "Prints the new file to stdout (or the unified diff with --diff, or writes the file "
            "with --write) and the statistics to stderr, with progress while the answer streams "
            "when stderr is a terminal. Without --model: FORETELL_MODEL, else the first model the "
            "server lists. The server: --base-url, else FORETELL_BASE_URL, else OPENAI_BASE_URL, "
            "else http://127.0.0.1:8000/v1."
        ),
    )
    edit.add_argument("file", metavar="FILE", help="the UTF-8 text file to edit")
    instruction = edit.add_mutually_exclusive_group(required=True)
    instruction.add_argument("--instruction", "-i", metavar="TEXT", help="what to change")
    instruction.add_argument("--instruction-file", metavar="F",
                             help="file holding the instruction ('-' reads stdin)")
    edit.add_argument("--model", default=env("FORETELL_MODEL"), metavar="M",
                      help="model name on the server (env: FORETELL_MODEL; default: the first "
                           "model the server lists)")
    edit.add_argument("--base-url", metavar="URL",
                      help="the server's OpenAI base URL (env: FORETELL_BASE_URL, then "
                           "OPENAI_BASE_URL; default: http://127.0.0.1:8000/v1)")
    edit.add_argument("--api-key", metavar="KEY",
                      help="API key (env: FORETELL_API_KEY, then OPENAI_API_KEY)")
    output = edit.add_mutually_exclusive_group()
    output.add_argument("--write", action="store_true",
                        help="replace FILE with the result (atomically; refused when FILE changed "
                             "meanwhile or the answer was cut off)")
    output.add_argument("--diff", action="store_true", help="print a unified diff instead of the file")
    edit.add_argument("--max-tokens", type=_positive_int, metavar="N",
                      help="most tokens to generate (default: enough for the whole file and growth)")
    edit.add_argument("--no-prompt-lookup", action="store_true",
                      help="ask a foretell server not to use prompt lookup as the prediction's fallback")
    edit.add_argument("--color", choices=CHOICES, default="auto",
                      help="colour the printed file by token origin, as the server reports it: green "
                           "from the prediction, cyan from prompt lookup, magenta from the draft cache "
                           "of earlier answers, plain the model's own (default: auto, when stdout "
                           "is a terminal and NO_COLOR is unset; not with --diff or --write)")
    edit.add_argument("--timeout", type=_seconds, default=None, metavar="S",
                      help="seconds the whole edit may take, from connecting to the last token "
                           "(default: no limit; each network wait is still limited to 600 s, "
                           "connecting to 10)")
    return parser


def _format_stats(stats, finish_reason: str) -> str:
    lines = [
        f"tokens: {stats.completion_tokens} ({finish_reason}), prompt: {stats.prompt_tokens}",
        f"target passes: {stats.target_passes} "
        f"({stats.target_passes / max(stats.completion_tokens, 1):.3f} per output token)",
        f"drafted: {stats.drafted_tokens}, accepted: {stats.accepted_tokens} "
        f"({100 * stats.acceptance_rate:.1f}%)",
    ]
    for name, source in stats.per_source.items():
        lines.append(f"  {name}: {source.rounds} rounds, drafted {source.drafted}, "
                     f"accepted {source.accepted}")
    if "prediction" in stats.per_source:
        lines.append(f"prediction tokens: {stats.accepted_prediction_tokens} accepted, "
                     f"{stats.rejected_prediction_tokens} rejected")
    lines.append(f"time: prefill {stats.prefill_seconds:.2f} s, decode {stats.decode_seconds:.2f} s, "
                 f"{stats.tokens_per_second:.1f} tok/s")
    return "\n".join(lines)


def run_generate(args: argparse.Namespace) -> int:
    prompt = _read_text(args.prompt_file, "prompt file")
    prediction = _read_text(args.prediction_file, "prediction file") if args.prediction_file else None
    if not prompt:
        raise SystemExit("foretell: the prompt file is empty")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a model hub at run time
    # The imports alone take seconds (torch, transformers): say something before them.
    print("foretell: loading the model...", file=sys.stderr, flush=True)
    with _needs_proxy_extra("generate"):
        from foretell.proxy.engine import GenerationRequest, SpeculativeEngine
        from foretell.proxy.engine.model_loader import load_model

    try:
        loaded = load_model(args.model, dtype=args.dtype or "auto", quantize=args.quantize or "auto",
                            fp32_head=args.fp32_head)
    except (ValueError, RuntimeError, OSError) as error:
        raise SystemExit(f"foretell: cannot load model: {error}") from None
    try:
        engine = SpeculativeEngine(loaded.model, loaded.tokenizer, fp32_head=args.fp32_head,
                                   kernels=args.kernels)
    except ValueError as error:
        raise SystemExit(f"foretell: {error}") from None
    print(f"foretell: precision {engine.precision}", file=sys.stderr)
    if not args.no_calibrate:
        from foretell.proxy.engine.calibration_cache import calibrate_with_cache

        cost = calibrate_with_cache(engine, loaded.source, recalibrate=args.recalibrate).pass_cost
        print(f"foretell: pass cost {1000 * cost.fixed:.0f} ms + {1000 * cost.per_position:.1f} ms "
              "per position", file=sys.stderr)
    prompt_ids = loaded.tokenizer(prompt)["input_ids"]
    request = GenerationRequest(
        prompt_ids=prompt_ids, max_tokens=args.max_tokens, prediction=prediction,
        prompt_lookup=args.prompt_lookup, stop=tuple(args.stop), max_draft=args.max_draft,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
    )

    spans = None
    if use_color(args.color, sys.stdout):
        from foretell.proxy.server.origins import OriginSpans

        spans = OriginSpans(loaded.tokenizer, request.stop)
        print(legend(), file=sys.stderr, flush=True)

    def show(update) -> None:
        if spans is None:
            sys.stdout.write(update.text)
        else:  # each piece in the colour of the draft source that wrote it
            spans.add(update.token_ids, update.origins)
            sys.stdout.write(paint_spans((s["text"], s["origin"]) for s in spans.split(update.text)))
        sys.stdout.flush()

    try:
        result = engine.generate(request, on_update=show)
    except ValueError as error:
        raise SystemExit(f"foretell: {error}") from None
    if not result.text.endswith("\n"):
        sys.stdout.write("\n")
    sys.stdout.flush()
    if args.json_stats:
        import json

        print(json.dumps({"finish_reason": result.finish_reason, "seed": result.seed,
                          **result.stats.as_dict()}), file=sys.stderr)
    else:
        print(_format_stats(result.stats, result.finish_reason), file=sys.stderr)
        if result.seed is not None:
            print(f"seed: {result.seed}", file=sys.stderr)
    return 0


def run_serve(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with _needs_proxy_extra("serve"):
        import uvicorn

        from foretell.proxy.server import ServerSettings, create_app
        from foretell.proxy.server.upstream import load_routes

    try:
        routes = load_routes(args.config)
        configured = routes.local_precision()
    except ValueError as error:
        raise SystemExit(f"foretell: {error}") from None
    # The command line or environment, else the configuration file's local route, else the default.
    for key, default in (("dtype", "auto"), ("quantize", "auto"), ("fp32_head", None)):
        if getattr(args, key) is None:
            setattr(args, key, configured.get(key, default))
    settings = ServerSettings(
        model=args.model, served_model_name=args.served_model_name, api_keys=tuple(args.api_key),
        max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
        max_prediction_chars=args.max_prediction_chars, default_max_tokens=args.default_max_tokens,
        calibrate=not args.no_calibrate, recalibrate=args.recalibrate, routes=routes,
        max_running=args.max_running, kv_cache_tokens=args.kv_cache_tokens,
        prefill_chunk=args.prefill_chunk, host=args.host,
        allowed_hosts=tuple(h.strip() for h in args.allowed_hosts.split(",") if h.strip()),
        metrics_public=args.metrics_public, dtype=args.dtype, quantize=args.quantize,
        fp32_head=args.fp32_head, kernels=args.kernels,
        draft_cache_scope=args.draft_cache_scope, draft_cache_tokens=args.draft_cache_tokens,
    )
    import logging

    from foretell.proxy.server.logs import configure_logging

    replicas = _replica_options(args)
    configure_logging(args.log_level, args.log_format)
    if replicas is not None:
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise SystemExit("foretell: --replicas needs Ray Serve (the ray extra): pip install 'foretell[ray]' "
                             "(from a checkout: bash scripts/setup.sh)")
        from foretell.proxy.replicas.launch import run_replicas

        return run_replicas(settings, replicas, args.host, args.port)
    logging.getLogger("foretell.server").info(
        "serving on http://%s:%s/v1 (loading the model; /health answers 503 until it is ready)",
        args.host, args.port)
    # uvicorn's own access log is off (foretell.access replaces it); its errors go through our handler.
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_config=None,
                log_level=args.log_level, access_log=False)
    return 0


def _replica_options(args: argparse.Namespace):
    """The replica options (None without --replicas); exits naming an option that needs
    --replicas or a combination that cannot work."""
    given = [f"--{name.replace('_', '-')}" for name in ("ray_address", "replica_cpus", "replica_gpus",
                                                         "min_replicas", "max_replicas")
             if getattr(args, name) is not None]
    if args.replicas is None:
        if given:
            raise SystemExit(f"foretell: {', '.join(given)} needs --replicas N")
        return None
    from foretell.proxy.replicas.options import ReplicaOptions

    options = ReplicaOptions(replicas=args.replicas, ray_address=args.ray_address, routing=args.routing,
                             replica_cpus=args.replica_cpus, replica_gpus=args.replica_gpus,
                             min_replicas=args.min_replicas, max_replicas=args.max_replicas)
    try:
        options.check()
    except ValueError as error:
        raise SystemExit(f"foretell: {error}") from None
    return options


class FileChangedError(Exception):
    """The file on disk is no longer the text the edit started from."""


def write_atomically(path: Path, text: str, expected: bytes) -> None:
    """Replace ``path`` with ``text`` (UTF-8) only if it still holds ``expected``: write a temporary
    file in the same directory, fsync it, give it the original's mode, check, then ``os.replace``.
    Any failure before the replace leaves the original untouched and removes the temporary file."""
    data = text.encode("utf-8")  # an unencodable result fails here, before anything is touched
    path = Path(os.path.realpath(path))  # edit a symlink's target, keep the link
    mode = stat.S_IMODE(os.stat(path).st_mode)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".foretell-tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temporary, mode)
        if path.read_bytes() != expected:
            raise FileChangedError(f"{path} changed on disk while the edit ran; not written")
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable where the OS allows
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


def _edit_stats(result) -> str:
    tokens = result.completion_tokens
    speed = result.tokens_per_second
    parts = [f"{tokens if tokens is not None else '?'} tokens ({result.finish_reason or '?'}) in "
             f"{result.seconds:.1f} s" + (f", {speed:.1f} tok/s" if speed else "")]
    if result.usage is not None:
        parts.append(f"prediction tokens: {result.accepted_prediction_tokens} accepted, "
                     f"{result.rejected_prediction_tokens} rejected")
    if result.speculation is not None and result.speculation.target_passes is not None:
        parts.append(f"target passes: {result.speculation.target_passes}")
    lines = result.diff.splitlines()[2:]  # after the '--- a/' and '+++ b/' headers
    added = sum(line.startswith("+") for line in lines)
    removed = sum(line.startswith("-") for line in lines)
    parts.append(f"+{added} -{removed} lines" if result.changed else "no changes")
    return "foretell edit: " + "; ".join(parts)


def run_edit(args: argparse.Namespace) -> int:
    # Only the SDK: `foretell edit` works with the bare `pip install foretell` (no torch).
    from foretell.sdk import Client, EditTruncatedError, ForetellError, edit_stream

    path = Path(args.file)
    original, text = _read_file(args.file, "file")
    instruction = args.instruction
    if instruction is None:
        instruction = _read_text(args.instruction_file, "instruction file")
    if not instruction.strip():
        raise SystemExit("foretell: the instruction is empty")

    progress = sys.stderr.isatty()
    color = not (args.write or args.diff) and use_color(args.color, sys.stdout)
    spans: list[tuple[str, str | None]] = []  # the answer in runs by origin, when colouring
    try:
        # --timeout is the SDK's deadline (the whole call), not its per-read timeout.
        with Client(args.base_url, args.api_key, deadline=args.timeout) as client:
            model = args.model or _first_model(client)
            stream = edit_stream(client, text, instruction, model=model, filename=path.name,
                                 max_tokens=args.max_tokens,
                                 prompt_lookup=False if args.no_prompt_lookup else None,
                                 report_origins=color)
            try:
                for step in stream:
                    if color:
                        spans.extend(step.origins if step.origins is not None else [(step.delta, None)])
                    if progress:
                        print(f"\rforetell edit: ~{step.approx_tokens} tokens, "
                              f"{step.tokens_per_second:.1f} tok/s", end="", file=sys.stderr, flush=True)
            finally:
                if progress:
                    print(file=sys.stderr)
    except EditTruncatedError as error:
        print(_edit_stats(error.result), file=sys.stderr)
        raise SystemExit(f"foretell: {error}; {args.file} was not changed") from None
    except (ForetellError, ValueError) as error:
        raise SystemExit(f"foretell: {error}") from None
    except KeyboardInterrupt:
        raise SystemExit(f"foretell: interrupted; {args.file} was not changed") from None

    result = stream.result
    print(_edit_stats(result), file=sys.stderr)
    if args.write:
        if result.changed:
            try:
                write_atomically(path, result.text, original)
            except (FileChangedError, OSError, UnicodeEncodeError) as error:
                raise SystemExit(f"foretell: {error}") from None
            print(f"foretell edit: wrote {args.file}", file=sys.stderr)
    elif args.diff:
        sys.stdout.write(result.diff)
    elif color:
        print(legend() if any(origin for _, origin in spans) else
              "foretell edit: the server reported no token origins (not a foretell server?)",
              file=sys.stderr)
        sys.stdout.write(paint_within(spans, result.text))
    else:
        sys.stdout.write(result.text)
    sys.stdout.flush()
    return 0


def _first_model(client) -> str:
    models = client.models.list().data
    if not models or not models[0].id:
        raise SystemExit("foretell: the server lists no models; pass --model")
    return models[0].id


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _resolve_env(args)
    if args.command == "generate":
        return run_generate(args)
    if args.command == "serve":
        return run_serve(args)
    if args.command == "edit":
        return run_edit(args)
    raise AssertionError(args.command)  # argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
