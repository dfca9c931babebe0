"""The simulated world, in rooms (docs/architecture.md has the map and where new things go).

- ``perf``: what the served model needs and what a step costs on a device (device profile,
  model shape, memory plan, cost model, the step-timer slot).
- ``run``: one simulated run (its config, the SimPy driver, metrics, outputs, decision log).
- ``studies``: many runs (sweeps, capacity search, fidelity against published figures).
- ``parallel`` and ``cluster``: where layouts over many devices and serving clusters go.

``devices/`` and ``models/`` hold the bundled device profiles and model shapes (TOML).
The command line is not here: ``sim/cli/`` is installed as its own package, ``kvsim.cli``.
"""
