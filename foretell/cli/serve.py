"""``foretell serve``: the OpenAI-compatible proxy on uvicorn, one engine or replicas on Ray Serve."""

from __future__ import annotations

import argparse
import os

from foretell.cli.arguments import add_options, needs_proxy_extra
from foretell.proxy.options import (ENGINE_OPTIONS, PRECISION_KEYS, PRECISION_OPTIONS, REPLICA_OPTIONS, RUN_OPTIONS,
                                    SERVER_OPTIONS)


def add_parser(commands) -> None:
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
    # Every option's name, default, variable and help: proxy/options.py.
    for options in (SERVER_OPTIONS, ENGINE_OPTIONS, PRECISION_OPTIONS, RUN_OPTIONS):
        add_options(serve, options)
    group = serve.add_argument_group(
        "replicas (Ray Serve; needs the ray extra: pip install 'foretell[ray]')",
        "Several engines behind one endpoint on the same --host/--port: an ingress routes each "
        "request to the replica holding its prompt's prefix in cache while load is even (else "
        "the least busy), retries a request whose replica died before answering, and answers "
        "/health and /metrics for all replicas.")
    add_options(group, REPLICA_OPTIONS)


def run(args: argparse.Namespace) -> int:
    replicas = _replica_options(args)  # before the imports (seconds): a wrong combination exits at once
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
    for key in PRECISION_KEYS:
        if getattr(args, key) is None:
            setattr(args, key, configured.get(key, "auto" if PRECISION_OPTIONS[key].kind == "choice" else None))
    settings = ServerSettings(
        model=args.model, served_model_name=args.served_model_name, api_keys=tuple(args.api_key),
        max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
        max_prediction_chars=args.max_prediction_chars, default_max_tokens=args.default_max_tokens,
        calibrate=not args.no_calibrate, recalibrate=args.recalibrate, routes=routes,
        max_running=args.max_running, kv_cache_tokens=args.kv_cache_tokens,
        prefill_chunk=args.prefill_chunk, host=args.host,
        allowed_hosts=tuple(h.strip() for h in args.allowed_hosts.split(",") if h.strip()),
        metrics_public=args.metrics_public, dtype=args.dtype, quantize=args.quantize,
        fp32_head=args.fp32_head, kernels=args.kernels, draft_model=args.draft_model,
        draft_cache_scope=args.draft_cache_scope, draft_cache_tokens=args.draft_cache_tokens,
        grammar_warmup=not args.no_grammar_warmup,
    )
    import logging

    from foretell.proxy.server.logs import configure_logging

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
    given = [option.flag for name, option in REPLICA_OPTIONS.items()
             if name not in ("replicas", "routing") and getattr(args, name) is not None]
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
