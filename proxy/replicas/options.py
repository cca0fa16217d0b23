"""The options of ``foretell serve --replicas N`` (the command line's replica group), checked
without Ray, so a bad combination fails before anything starts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ReplicaOptions:
    replicas: int
    ray_address: str | None = None
    routing: str = "affinity"
    replica_cpus: float | None = None  # None: one each, or a fair share of a local instance's cores
    replica_gpus: float | None = None  # None: one each where the cluster has GPUs, else none
    min_replicas: int | None = None  # either bound given: autoscaling on ongoing requests
    max_replicas: int | None = None
    imbalance: int = 4  # ongoing requests a replica may be ahead of the least busy and keep affinity

    def autoscaling(self) -> dict | None:
        if self.min_replicas is None and self.max_replicas is None:
            return None
        low = self.min_replicas if self.min_replicas is not None else 1
        high = self.max_replicas if self.max_replicas is not None else max(self.replicas, low)
        return {"min_replicas": low, "max_replicas": high, "initial_replicas": self.replicas}

    def check(self) -> None:
        """ValueError for options that cannot work together."""
        if self.replicas < 1:
            raise ValueError("--replicas must be at least 1")
        scaling = self.autoscaling()
        if scaling and not scaling["min_replicas"] <= self.replicas <= scaling["max_replicas"]:
            raise ValueError(f"--replicas {self.replicas} is outside --min-replicas {scaling['min_replicas']} "
                             f"and --max-replicas {scaling['max_replicas']}")
        if scaling and scaling["min_replicas"] < 1:
            raise ValueError("--min-replicas must be at least 1 (the ingress asks a replica for the model's name)")
