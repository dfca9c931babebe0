"""One run, simulated or executed: its configuration, the driver loop and what it writes.

``config`` resolves a RunConfig into an engine, a model, a device and a memory plan;
``simulator`` is the SimPy loop (schedule, time, commit); ``runner`` drives it for either
world and writes the run directory (``outputs``, ``metrics``, ``decisions``,
``run_warnings``; ``run_dir`` stages it so a failed run leaves nothing half written).
"""
