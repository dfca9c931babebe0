"""A serving cluster: instances behind a router in one event loop.

``routers`` holds the Router interface, the built-in routers and plug-in loading; ``cluster`` runs
the instances (one EngineCore each) and the router in one SimPy environment; ``runner`` writes a
cluster run's directory; ``autoscaler`` decides how many instances serve; ``disagg`` runs prefill and
decode pools with the prompt's KV moving between them at ``kv_transfer``'s price. Still to come here:
KV tiers under an instance's block pool. With one instance every output stays
byte-identical to a single-engine run (the CLI runs that case as a single engine).
"""
