"""A user router: requests whose prompts start with the same block go to the same instance.

    kvsim simulate --trace mooncake_500 --model qwen2.5-7b --instances 4 \
        --router first_block_router:FirstBlockRouter --out runs/first-block   # with examples/ on PYTHONPATH

A router is a class with ``choose(request, view) -> instance index``; ``routed`` and ``ended``
are optional hooks (kvsim.sim.cluster.routers.Router documents all three).
"""

from __future__ import annotations

from kvsim.sim.cluster.routers import ClusterView, Router, RouteRequest


class FirstBlockRouter(Router):
    """Hash of the first prompt block modulo the instances; the least busy one without hashes."""

    def choose(self, request: RouteRequest, view: ClusterView) -> int:
        if request.prefix_hashes:
            return request.prefix_hashes[0] % view.size
        return min(range(view.size), key=view.in_flight.__getitem__)
