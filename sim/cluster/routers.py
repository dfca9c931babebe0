"""Routers: which instance of a cluster serves each arriving request.

A router sees a read-only :class:`ClusterView` (each instance's queue and KV usage, refreshed as
real routers scrape metrics: possibly stale by an interval) and keeps its own in-flight counters,
raised when it routes a request and lowered when the request ends, as llm-d's and vLLM's routers
do. Built-ins, by name:

- ``round-robin``: instances in turn.
- ``least-requests``: the fewest requests in flight (the router's own counters).
- ``least-kv``: the lowest KV-block usage in the view.
- ``session``: a conversation stays on the instance its first request went to (``session_id``
  in the trace); other requests and first turns go to the fewest in flight.
- ``kv-aware``: llm-d's weighted scorers: ``prefix_weight x`` the share of the prompt's prefix
  blocks the instance was routed before (an approximate prefix index from routing history) ``+
  queue_weight x (max_q - q) / (max_q - min_q)`` over in-flight counts ``+ kv_weight x (1 - KV
  usage)``; highest wins, ties to the lower index. Defaults 3 / 2 / 0: llm-d's default profile
  weighs queue depth 2 and prefix-cache hits 3 (Red Hat OpenShift AI 3.4, "Configuring scheduler
  settings for LLM inference services",
  https://docs.redhat.com/en/documentation/red_hat_openshift_ai_self-managed/3.4/html/deploy_models_using_distributed_inference_with_llm-d/configuring-llm-scheduler).

A router is a plug-in like a scheduler: a class with ``choose(request, view) -> int`` (and
optionally ``routed`` / ``ended``) named ``module:Class`` (examples/sticky_router.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvsim.policies.registry import build, register_in

ROUTERS: dict[str, type] = {}


class RouterError(ValueError):
    """A router's own failure (it raised, or chose no instance): the user's plug-in, not kvsim."""


@dataclass(frozen=True)
class RouteRequest:
    """What a router may read of an arriving request."""

    index: int  # the trace row
    arrival_s: float
    prompt_tokens: int
    prefix_hashes: tuple[int, ...]  # the trace's prompt-block hashes (empty without them)
    session_id: int | None


@dataclass(frozen=True)
class InstanceState:
    """One instance as the view shows it (a scrape: possibly stale)."""

    waiting: int
    running: int
    kv_usage: float  # used KV blocks / total


@dataclass(frozen=True)
class ClusterView:
    """Every instance's scraped state, and the router's own in-flight counters (always current)."""

    instances: tuple[InstanceState, ...]
    in_flight: tuple[int, ...]
    scraped_at_s: float
    serving: tuple[bool, ...] = ()  # which instances take new requests (an autoscaler's); empty: all

    @property
    def size(self) -> int:
        return len(self.instances)

    def candidates(self) -> list[int]:
        """The instances a request may go to."""
        return [i for i in range(len(self.instances)) if not self.serving or self.serving[i]]


class Router:
    """Base class: counters the cluster keeps for it need no code; override :meth:`choose`."""

    registered_name = ""

    def choose(self, request: RouteRequest, view: ClusterView) -> int:
        raise NotImplementedError

    def routed(self, request: RouteRequest, instance: int) -> None:
        """The request went to ``instance`` (after :meth:`choose`)."""

    def ended(self, index: int, instance: int) -> None:
        """The request of trace row ``index`` finished or was rejected on ``instance``."""


def register_router(name: str) -> Callable[[type], type]:
    return register_in(ROUTERS, "router", name)


def make_router(spec: str, params: dict | None = None) -> Router:
    """A built-in router by name, or a user's as ``module:Class``, with its parameters."""
    return build(ROUTERS, "router", spec, params)


def _fewest(view: ClusterView, counts: tuple[int, ...] | list[float]) -> int:
    return min(view.candidates(), key=counts.__getitem__)


@register_router("round-robin")
class RoundRobin(Router):
    def __init__(self) -> None:
        self.next = 0

    def choose(self, request: RouteRequest, view: ClusterView) -> int:
        candidates = view.candidates()
        chosen = next((i for i in candidates if i >= self.next), candidates[0])
        self.next = chosen + 1
        return chosen


@register_router("least-requests")
class LeastRequests(Router):
    def choose(self, request: RouteRequest, view: ClusterView) -> int:
        return _fewest(view, view.in_flight)


@register_router("least-kv")
class LeastKV(Router):
    def choose(self, request: RouteRequest, view: ClusterView) -> int:
        return _fewest(view, [s.kv_usage for s in view.instances])


@register_router("session")
class SessionAffinity(Router):
    def __init__(self) -> None:
        self.home: dict[int, int] = {}

    def choose(self, request: RouteRequest, view: ClusterView) -> int:
        home = self.home.get(request.session_id) if request.session_id is not None else None
        if home is not None and home in view.candidates():
            return home
        return _fewest(view, view.in_flight)

    def routed(self, request: RouteRequest, instance: int) -> None:
        if request.session_id is not None:
            self.home[request.session_id] = instance


@register_router("kv-aware")
class KVAware(Router):
    """llm-d's weighted scorers over an approximate prefix index (module docstring)."""

    def __init__(self, prefix_weight: float = 3.0, queue_weight: float = 2.0, kv_weight: float = 0.0,
                 index_blocks: int = 1_000_000) -> None:
        if min(prefix_weight, queue_weight, kv_weight) < 0 or index_blocks < 1:
            raise ValueError("weights must be >= 0 and index_blocks >= 1")
        self.weights = (prefix_weight, queue_weight, kv_weight)
        self.index_blocks = index_blocks
        self.seen: OrderedDict[tuple[int, int], None] = OrderedDict()  # (instance, chained block hash), LRU
        self.holders: dict[int, set[int]] = {}  # chained block hash -> the instances in ``seen`` with it

    def choose(self, request: RouteRequest, view: ClusterView) -> int:
        prefix_w, queue_w, kv_w = self.weights
        candidates = view.candidates()
        counts = view.in_flight
        lo, hi = min(counts[i] for i in candidates), max(counts[i] for i in candidates)
        matched = self._matched_blocks(request.prefix_hashes)
        blocks = len(request.prefix_hashes) or 1
        best, best_score = candidates[0], -1.0
        for i in candidates:
            queue = (hi - counts[i]) / (hi - lo) if hi > lo else 1.0
            score = prefix_w * (matched.get(i, 0) / blocks) + queue_w * queue + kv_w * (1.0 - view.instances[i].kv_usage)
            if score > best_score:
                best, best_score = i, score
        return best

    def _matched_blocks(self, hashes: tuple[int, ...]) -> dict[int, int]:
        """Per instance, the leading prompt blocks this router sent it before (absent: none), in one
        walk down the prompt: the instances still matching narrow block by block."""
        matched: dict[int, int] = {}
        alive = self.holders.get(hashes[0], set()) if hashes else set()
        for depth, h in enumerate(hashes):
            if not alive:
                break
            still = alive & self.holders.get(h, set())
            for i in alive - still:
                matched[i] = depth
            alive = still
        for i in alive:
            matched[i] = len(hashes)
        return matched

    def routed(self, request: RouteRequest, instance: int) -> None:
        seen, holders = self.seen, self.holders
        for h in request.prefix_hashes:
            key = (instance, h)
            if key in seen:
                seen.move_to_end(key)
            else:
                seen[key] = None
                holders.setdefault(h, set()).add(instance)
        while len(seen) > self.index_blocks:
            gone, h = seen.popitem(last=False)[0]
            holders[h].discard(gone)
            if not holders[h]:
                del holders[h]
