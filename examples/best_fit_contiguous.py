"""A user's block manager: contiguous regions placed best fit instead of first fit.

First fit puts a new region in the lowest free extent that holds it, so a small region can
split the one hole a later large region needed; best fit takes the smallest extent that holds
it and leaves large holes whole. Load it by path, ``--block-manager
best_fit_contiguous:BestFitContiguous`` with this directory on ``sys.path``; it takes the
same parameters as ``contiguous`` (``max_model_len``, ``reserve``).
"""

from __future__ import annotations

from kvsim.policies.contiguous import ContiguousBlockManager


class BestFitContiguous(ContiguousBlockManager):
    def choose_extent(self, n: int) -> int | None:
        """The smallest free extent that holds ``n`` blocks (the lowest of equals)."""
        fits = [(length, i) for i, (_, length) in enumerate(self.extents) if length >= n]
        return min(fits)[1] if fits else None
