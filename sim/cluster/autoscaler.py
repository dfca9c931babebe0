"""Autoscalers: how many instances a cluster runs, decided from the block managers' statistics.

Every ``interval_s`` the cluster asks its autoscaler for a change (+1, 0 or -1) given the view of
the instances in service. A new instance serves after a cold start: its weights read at
``load_bandwidth`` (B/s; 2 GB/s by default, a stated assumption for a local NVMe read, not a
measured figure) plus ``start_s`` of engine start-up. An instance scaled down takes no new
request and leaves once its last one ends. Built-in, by name:

- ``kv-utilization`` (the design documents' default): up when the mean KV-block usage of the
  instances in service exceeds ``target`` (0.8) and their waiting requests exceed
  ``queue_threshold`` (100); down when the usage falls below half the target and nothing waits.
- ``queue``: up when more than ``per_instance`` requests wait per instance in service, down when
  none wait and the instances hold less than a quarter of ``per_instance`` running requests each.

Policies plug in like routers (``module:Class``, a ``decide(view) -> int`` method).
"""

from __future__ import annotations

from collections.abc import Callable

from kvsim.policies.registry import build, register_in
from kvsim.sim.cluster.routers import ClusterView

AUTOSCALERS: dict[str, type] = {}
DEFAULT_LOAD_BANDWIDTH = 2e9  # B/s: weights read from a local NVMe (assumed)


def register_autoscaler(name: str) -> Callable[[type], type]:
    return register_in(AUTOSCALERS, "autoscaler", name)


class Autoscaler:
    """Base class: ``decide`` returns +1 (launch one), -1 (retire one) or 0."""

    registered_name = ""

    def decide(self, view: ClusterView) -> int:
        raise NotImplementedError


@register_autoscaler("kv-utilization")
class KVUtilization(Autoscaler):
    def __init__(self, target: float = 0.8, queue_threshold: int = 100) -> None:
        if not 0 < target <= 1 or queue_threshold < 0:
            raise ValueError("target must be in (0, 1] and queue_threshold >= 0")
        self.target, self.queue_threshold = target, queue_threshold

    def decide(self, view: ClusterView) -> int:
        usage = sum(s.kv_usage for s in view.instances) / view.size
        waiting = sum(s.waiting for s in view.instances)
        if usage > self.target and waiting > self.queue_threshold:
            return 1
        if usage < self.target / 2 and waiting == 0:
            return -1
        return 0


@register_autoscaler("queue")
class QueueDepth(Autoscaler):
    def __init__(self, per_instance: int = 32) -> None:
        if per_instance < 1:
            raise ValueError("per_instance must be >= 1")
        self.per_instance = per_instance

    def decide(self, view: ClusterView) -> int:
        waiting = sum(s.waiting for s in view.instances)
        running = sum(s.running for s in view.instances)
        if waiting > self.per_instance * view.size:
            return 1
        if waiting == 0 and running < self.per_instance * view.size / 4:
            return -1
        return 0


def make_autoscaler(spec: str, params: dict | None = None) -> Autoscaler:
    """A built-in autoscaler by name, or a user's as ``module:Class``, with its parameters."""
    return build(AUTOSCALERS, "autoscaler", spec, params)
