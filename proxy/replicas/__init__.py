"""Several engines behind one endpoint: ``foretell serve --replicas N`` on Ray Serve.

- ``routing.py``: the placement policy (prefix affinity over KV-cache blocks, round-robin), pure.
- ``routers.py``: that policy as Ray Serve request routers.
- ``replica.py``: one replica, one engine, its ``foretell serve`` app called in-process.
- ``ingress.py``: the HTTP entry: affinity hints, upstream routes, /health and /metrics for all.
- ``cluster_metrics.py``: the replicas' Prometheus metrics merged, per replica and in sum.
- ``launch.py``: Ray and Serve started (or joined), the application run, shut down on a signal.
"""
