"""``foretell serve --replicas N``: Ray (a local instance, or the cluster at ``--ray-address``),
Serve's HTTP proxy on ``--host``/``--port``, and one application: the ingress (``ingress.py``)
in front of N engine replicas (``replica.py``) routed by ``--routing`` (``routers.py``),
autoscaled between ``--min-replicas`` and ``--max-replicas`` on ongoing requests when either is
given. Runs until SIGINT or SIGTERM; then a local Ray instance is shut down whole, and on a
joined cluster only this application is deleted."""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

from foretell.proxy.replicas.options import ReplicaOptions
from foretell.proxy.server.settings import ServerSettings

log = logging.getLogger("foretell.server")

APP_NAME = "foretell"
# The environment a replica needs from ours (precision, kernels, offline hub, threads): handed
# over explicitly, since the workers of a joined cluster do not inherit it.
PASSED_ENV_PREFIXES = ("FORETELL_", "HF_", "TRITON_", "OMP_", "TOKENIZERS_")
# Where `ray start` and a local instance keep the cluster's authentication token.
TOKEN_PATH = Path.home() / ".ray" / "auth_token"


def passed_env() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name.startswith(PASSED_ENV_PREFIXES)}


def build_app(settings: ServerSettings, options: ReplicaOptions, cluster_cpus: float, cluster_gpus: float):
    """The Serve application: the ingress bound to the engine deployment."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from foretell.proxy.replicas.ingress import Ingress
    from foretell.proxy.replicas.replica import EngineReplica
    from foretell.proxy.replicas.routers import ROUTERS

    scaling = options.autoscaling()
    most = scaling["max_replicas"] if scaling else options.replicas
    gpus = options.replica_gpus if options.replica_gpus is not None else (1 if cluster_gpus >= 1 else 0)
    cpus = options.replica_cpus if options.replica_cpus is not None else \
        (1 if gpus or options.ray_address else min(1.0, round(cluster_cpus / most, 2)))
    runtime_env = {"env_vars": passed_env()}
    if scaling:
        # A replica batches max_running sequences well: scale out when they are all busy.
        scaling["target_ongoing_requests"] = settings.max_running
    router = RequestRouterConfig(
        request_router_class=ROUTERS[options.routing],
        request_router_kwargs={"imbalance": options.imbalance} if options.routing == "affinity" else {},
        request_routing_stats_period_s=1, request_routing_stats_timeout_s=5)
    engine = serve.deployment(
        EngineReplica, name="EngineReplica",
        num_replicas=None if scaling else options.replicas, autoscaling_config=scaling,
        # A replica takes what its batch runs; Serve holds the rest at the router, for whichever
        # replica frees first (an engine's own queue would keep them from a replica added later).
        max_ongoing_requests=settings.max_running,
        ray_actor_options={"num_cpus": cpus, "num_gpus": gpus, "runtime_env": runtime_env},
        request_router_config=router, health_check_period_s=5, health_check_timeout_s=30,
    ).bind(settings)
    ingress = serve.deployment(
        Ingress, name="Ingress", num_replicas=1, max_ongoing_requests=1024,
        ray_actor_options={"num_cpus": 0, "runtime_env": runtime_env},
    ).bind(settings, engine)
    log.info("replicas: %s, %s CPU and %s GPU each, routing %s", scaling or options.replicas, cpus, gpus,
             options.routing)
    return ingress


def run_replicas(settings: ServerSettings, options: ReplicaOptions, host: str, port: int) -> int:
    if options.ray_address and "RAY_AUTH_MODE" not in os.environ and TOKEN_PATH.exists():
        # A cluster started with `ray start` has token authentication on; Ray's driver looks for
        # the token by itself only with --ray-address auto. Set before Ray is first imported.
        os.environ["RAY_AUTH_MODE"] = "token"
    import ray
    from ray import serve

    from foretell.proxy.engine.model_loader import resolve_model_folder

    if options.ray_address is None:
        resolve_model_folder(settings.model)  # converted once here, before the replicas look for it
    ray.init(address=options.ray_address, include_dashboard=False, namespace=APP_NAME,
             runtime_env={"env_vars": passed_env()}, log_to_driver=True)
    stop = threading.Event()  # set by a signal; the handlers replace any Ray installed
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        resources = ray.cluster_resources()
        log.info("Ray: %s at %s (%s CPUs, %s GPUs)", "joined cluster" if options.ray_address else "local instance",
                 ray.get_runtime_context().gcs_address, resources.get("CPU", 0), resources.get("GPU", 0))
        serve.start(http_options={"host": host, "port": port})
        app = build_app(settings, options, resources.get("CPU", 1), resources.get("GPU", 0))
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        log.info("serving on http://%s:%s/v1 (%s replicas, routing %s)", host, port, options.replicas,
                 options.routing)
        while not stop.wait(0.5):
            pass
        log.info("stopping")
    finally:
        if options.ray_address is None:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)  # the cluster and its other applications stay
        ray.shutdown()
    return 0
