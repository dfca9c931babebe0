"""The engine core both worlds drive: request state, block managers, schedulers, step plans.

Pure Python (no SimPy, no torch). Importing the package registers the built-in policies by
name (``fcfs``, ``chunked``, ``priority``, ``sjf``, ``static``, ``vllm-v0``; ``paged``,
``prefix``, ``contiguous``) through the decorators in their own modules.
"""

from kvsim.policies import contiguous, paged, schedulers, v0_scheduler  # noqa: F401  (registration)
