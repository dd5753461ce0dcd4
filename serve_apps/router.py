"""Session affinity for the draft and target deployments.

Each request keeps KV state on ONE replica of each deployment, so every call of a
request must reach the replica that holds it. This Ray Serve request router picks, for
the routing key passed as the first argument (a request id for the draft deployment
and ``/recommend``; a target key, :func:`target_key`, that groups requests for the
target), the replica with the highest rendezvous hash of (key, replica id): stable
while the replica set is stable. When a replica dies only ITS keys move (their
requests fail with a clear "no state" error) while the others keep their replica; a
replica added by scaling up takes over some keys, whose requests in flight fail the
same way. Calls without a key (``info``) go to any replica.
"""

from __future__ import annotations

import hashlib
import zlib

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica


def target_key(rid: str, buckets: int) -> str:
    """The target routing key of request ``rid``: one of ``buckets`` keys, so a draft
    replica verifies the requests of one key (all on one target replica) in one call."""
    return f"t{zlib.crc32(rid.encode()) % max(buckets, 1)}"


def _score(rid: str, replica: RunningReplica) -> int:
    digest = hashlib.blake2b(f"{rid}|{replica.replica_id.unique_id}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "big")


class SessionAffinityRouter(FIFOMixin, RequestRouter):
    """Routes a call whose first argument is a request id to that request's replica."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        args = pending_request.args if pending_request is not None else []
        if not args or not isinstance(args[0], str):
            return [candidate_replicas]
        return [[max(candidate_replicas, key=lambda r: _score(args[0], r))]]
