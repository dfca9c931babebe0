"""Ray, for what spreads over it (a sweep's simulations, a cluster's instances): imported on first
use, so Ray stays an optional extra, and joined to the cluster ``RAY_ADDRESS`` names (a local one
started otherwise)."""

from __future__ import annotations

import os


def require_ray():
    """The ``ray`` module; a ValueError naming the extra when Ray is not installed."""
    try:
        import ray
    except ImportError:
        raise ValueError("the ray backend needs Ray: pip install 'kvsim[dist]'") from None
    return ray


def connected_ray():
    """The ``ray`` module, initialised."""
    ray = require_ray()
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), ignore_reinit_error=True, log_to_driver=False)
    return ray
