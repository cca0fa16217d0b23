"""``routing.py``'s policies as Ray Serve request routers (Serve's alpha ``RequestRouter`` API).

A router lives in the process holding the deployment handle (the ingress). Serve gives it the
replicas, their ongoing-request counts and the stats each replica reports (``record_routing_stats``:
queue, batch, KV-cache usage and metrics); ``choose_replicas`` returns ranks of replicas and Serve
sends the request to the least busy replica of the first rank with room (``max_ongoing_requests``).
The ingress reads the replicas' reported stats through ``replica_stats`` for /health and /metrics.
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from foretell.proxy.replicas import routing
from foretell.proxy.replicas.routing import AffinityTable, RoundRobin, rank_by_affinity


def replica_stats() -> dict[str, dict]:
    """The last stats each running replica reported, by replica id (from every router of this
    process: each handle's own router sees the same replicas)."""
    stats: dict[str, dict] = {}
    for router in list(routing.LIVE_ROUTERS):
        for replica_id, replica in router.curr_replicas.items():
            stats[replica_id.unique_id] = dict(replica.routing_stats or {})
    return stats


def _hint(pending: PendingRequest | None) -> list[int]:
    """The request's block hashes (the ingress puts them on the ``ForwardedRequest``)."""
    if pending is None or not pending.args:
        return []
    return list(getattr(pending.args[0], "block_hashes", ()) or ())


class _ReportingRouter(RequestRouter):
    def initialize_state(self, **kwargs):
        routing.LIVE_ROUTERS.add(self)

    async def _loads(self, candidates: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Ongoing requests per candidate: Serve's cached counts, probed where it has none."""
        loads, unknown = {}, []
        for replica in candidates:
            count = self.replica_queue_len_cache.get(replica.replica_id)
            if count is None:
                unknown.append(replica)
            else:
                loads[replica.replica_id] = count
        if unknown:
            for replica, count in await self._probe_queue_lens(unknown, 0):
                loads[replica.replica_id] = count if count is not None else replica.max_ongoing_requests
        return loads


class PrefixAffinityRouter(_ReportingRouter):
    """The replica holding the request's longest chain of cached blocks, unless it is more than
    ``imbalance`` ongoing requests busier than the least busy (then the least busy)."""

    def initialize_state(self, imbalance: int = 4, table_size: int = 200_000, **kwargs):
        super().initialize_state(**kwargs)
        self.imbalance = imbalance
        self.table = AffinityTable(table_size)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        loads = await self._loads(candidate_replicas)
        ranks = rank_by_affinity(self.table, _hint(pending_request), loads, self.imbalance)
        return [[by_id[replica_id] for replica_id in rank] for rank in ranks if rank]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self.table.record(_hint(pending_request), replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]):
        gone = set(self.curr_replicas) - {replica.replica_id for replica in replicas}
        for replica_id in gone:
            self.table.forget(replica_id)
        return super().update_replicas(replicas)


class RoundRobinRouter(_ReportingRouter):
    """Each replica in turn, whatever the prompt (the benchmark's baseline)."""

    def initialize_state(self, **kwargs):
        super().initialize_state(**kwargs)
        self.turns = RoundRobin()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        return [[by_id[replica_id] for replica_id in rank] for rank in self.turns.rank(list(by_id)) if rank]


ROUTERS = {"affinity": PrefixAffinityRouter, "round-robin": RoundRobinRouter}
