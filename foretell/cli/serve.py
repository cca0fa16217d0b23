"""``foretell serve``: the OpenAI-compatible proxy on uvicorn, one engine or replicas on Ray Serve."""

from __future__ import annotations

import argparse
import os

from foretell.cli.arguments import (FromEnv, add_kernels_option, add_precision_options, log_format,
                                    log_level, needs_proxy_extra, non_negative_float, one_of, positive_int)
from foretell.proxy.options import (DEFAULT_MAX_TOKENS, DRAFT_CACHE_SCOPES, DRAFT_CACHE_TOKENS, KV_CACHE_TOKENS,
                                    MAX_BODY_BYTES, MAX_PREDICTION_CHARS, MAX_QUEUE, MAX_RUNNING, PREFILL_CHUNK,
                                    REPLICA_ROUTINGS)


def add_parser(commands) -> None:
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
    serve.add_argument("--port", type=int, default=FromEnv("FORETELL_PORT", 8000, int),
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
    _add_engine_options(serve)


def _add_engine_options(serve: argparse.ArgumentParser) -> None:
    """The local engine's sizes and precision, the logs and the replicas."""
    env = os.environ.get
    serve.add_argument("--max-queue", type=positive_int,
                       default=FromEnv("FORETELL_MAX_QUEUE", MAX_QUEUE, positive_int),
                       help=f"requests waiting for the engine before 429 (default: {MAX_QUEUE}) "
                            "(env: FORETELL_MAX_QUEUE)")
    serve.add_argument("--max-running", type=positive_int,
                       default=FromEnv("FORETELL_MAX_RUNNING", MAX_RUNNING, positive_int),
                       help="requests batched into each target pass at once; more wait in the queue "
                            f"(default: {MAX_RUNNING}) (env: FORETELL_MAX_RUNNING)")
    serve.add_argument("--kv-cache-tokens", type=positive_int,
                       default=FromEnv("FORETELL_KV_CACHE_TOKENS", KV_CACHE_TOKENS, positive_int),
                       help="KV cache capacity in tokens (full-attention layers; sliding-window "
                            "layers keep only their window); a request that can never fit is "
                            f"refused with 400 (default: {KV_CACHE_TOKENS}) (env: FORETELL_KV_CACHE_TOKENS)")
    serve.add_argument("--prefill-chunk", type=positive_int,
                       default=FromEnv("FORETELL_PREFILL_CHUNK", PREFILL_CHUNK, positive_int),
                       help="prompt tokens prefilled per step, so a long prompt stalls running "
                            f"streams by one chunk at most (default: {PREFILL_CHUNK}) (env: FORETELL_PREFILL_CHUNK)")
    serve.add_argument("--draft-cache-scope", type=one_of(DRAFT_CACHE_SCOPES),
                       default=FromEnv("FORETELL_DRAFT_CACHE_SCOPE", "key", one_of(DRAFT_CACHE_SCOPES)),
                       help="drafts from earlier answers (a suffix-tree cache, beside predictions and "
                            "prompt lookup), kept apart per tenant: key (default: per API key where "
                            "--api-key is set, else per request 'user', else one shared cache), "
                            "user (per 'user' within each key), global (one cache for all: "
                            "acceptance, and so latency, then depends on what others asked) or off. "
                            "A request opts out with speculation: {\"draft_cache\": false} "
                            "(env: FORETELL_DRAFT_CACHE_SCOPE)")
    serve.add_argument("--draft-cache-tokens", type=positive_int,
                       default=FromEnv("FORETELL_DRAFT_CACHE_TOKENS", DRAFT_CACHE_TOKENS, positive_int),
                       help="output tokens the draft cache holds, all scopes together; the oldest "
                            f"answers go first (default: {DRAFT_CACHE_TOKENS}, about 0.25 GB) "
                            "(env: FORETELL_DRAFT_CACHE_TOKENS)")
    serve.add_argument("--max-body-bytes", type=positive_int,
                       default=FromEnv("FORETELL_MAX_BODY_BYTES", MAX_BODY_BYTES, positive_int),
                       help="largest request body, else 413 (default: 4 MiB) (env: FORETELL_MAX_BODY_BYTES)")
    serve.add_argument("--max-prediction-chars", type=positive_int,
                       default=FromEnv("FORETELL_MAX_PREDICTION_CHARS", MAX_PREDICTION_CHARS, positive_int),
                       help="largest prediction, else 413 (default: 1 Mi characters) "
                            "(env: FORETELL_MAX_PREDICTION_CHARS)")
    serve.add_argument("--default-max-tokens", type=positive_int,
                       default=FromEnv("FORETELL_DEFAULT_MAX_TOKENS", DEFAULT_MAX_TOKENS, positive_int),
                       help=f"chat max_tokens when the request sets none (default: {DEFAULT_MAX_TOKENS}; completions "
                            "default to 16 as OpenAI's) (env: FORETELL_DEFAULT_MAX_TOKENS)")
    add_precision_options(serve)
    add_kernels_option(serve)
    serve.add_argument("--no-calibrate", action="store_true",
                       default=env("FORETELL_NO_CALIBRATE", "") not in ("", "0"),
                       help="skip measuring the pass cost at start-up (env: FORETELL_NO_CALIBRATE=1)")
    serve.add_argument("--recalibrate", action="store_true",
                       default=env("FORETELL_RECALIBRATE", "") not in ("", "0"),
                       help="measure the pass cost again instead of reusing this machine's cached "
                            "calibration of the model (env: FORETELL_RECALIBRATE=1)")
    serve.add_argument("--log-level", type=log_level, metavar="LEVEL",
                       default=FromEnv("FORETELL_LOG_LEVEL", "info", log_level),
                       help="debug, info (default), warning or error; info logs one foretell.access "
                            "line per request (env: FORETELL_LOG_LEVEL)")
    serve.add_argument("--log-format", type=log_format, metavar="FORMAT",
                       default=FromEnv("FORETELL_LOG_FORMAT", "text", log_format),
                       help="text (default) or json (one object a line) on stderr "
                            "(env: FORETELL_LOG_FORMAT)")
    _add_replica_options(serve)


def _add_replica_options(command: argparse.ArgumentParser) -> None:
    env = os.environ.get
    group = command.add_argument_group(
        "replicas (Ray Serve; needs the ray extra: pip install 'foretell[ray]')",
        "Several engines behind one endpoint on the same --host/--port: an ingress routes each "
        "request to the replica holding its prompt's prefix in cache while load is even (else "
        "the least busy), retries a request whose replica died before answering, and answers "
        "/health and /metrics for all replicas.")
    group.add_argument("--replicas", type=positive_int, metavar="N",
                       default=FromEnv("FORETELL_REPLICAS", None, positive_int),
                       help="serve N engine replicas on Ray Serve (default: one engine, no Ray) "
                            "(env: FORETELL_REPLICAS)")
    group.add_argument("--ray-address", metavar="ADDR", default=env("FORETELL_RAY_ADDRESS"),
                       help="join the Ray cluster at ADDR (auto, or the head's HOST:PORT that `ray start "
                            "--head` prints) instead of "
                            "starting a local Ray instance; on exit only this application is "
                            "removed (env: FORETELL_RAY_ADDRESS)")
    group.add_argument("--routing", type=one_of(REPLICA_ROUTINGS),
                       default=FromEnv("FORETELL_ROUTING", "affinity", one_of(REPLICA_ROUTINGS)),
                       help="affinity (default: prefix-cache affinity, shedding to the least busy "
                            "replica when one is 4 requests ahead) or round-robin (env: FORETELL_ROUTING)")
    group.add_argument("--replica-cpus", type=non_negative_float, metavar="C",
                       default=FromEnv("FORETELL_REPLICA_CPUS", None, non_negative_float),
                       help="CPUs reserved per replica (default: 1, or a fair share of a local "
                            "instance's cores) (env: FORETELL_REPLICA_CPUS)")
    group.add_argument("--replica-gpus", type=non_negative_float, metavar="G",
                       default=FromEnv("FORETELL_REPLICA_GPUS", None, non_negative_float),
                       help="GPUs per replica (default: 1 where the cluster has GPUs, else 0) "
                            "(env: FORETELL_REPLICA_GPUS)")
    group.add_argument("--min-replicas", type=positive_int, metavar="N",
                       default=FromEnv("FORETELL_MIN_REPLICAS", None, positive_int),
                       help="autoscale on ongoing requests (a replica's --max-running each), down "
                            "to N replicas (env: FORETELL_MIN_REPLICAS)")
    group.add_argument("--max-replicas", type=positive_int, metavar="N",
                       default=FromEnv("FORETELL_MAX_REPLICAS", None, positive_int),
                       help="autoscale up to N replicas (env: FORETELL_MAX_REPLICAS)")


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with needs_proxy_extra("serve"):
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
