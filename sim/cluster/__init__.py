"""A serving cluster: the room for instances, routers, KV transfers and tiers, and autoscaling.

Empty until the "serving cluster" work lands (the design card's Round 3 is the plan).
What goes here: instances (one EngineCore each) behind a router in one event loop; a router
is a small strategy that picks an instance for each arrival from a read-only cluster view
(possibly stale by an interval) plus its own in-flight counters, as a scheduler reads
``policies.view.EngineView``; prefill and decode pools exchange KV as timed transfers; KV tiers
(host, SSD, a shared pool) sit under an instance's block pool, evicted blocks demoting and hits
promoting at a transfer's cost; an autoscaler adds and removes instances with a cold start.
With one instance, TP 1 and tiers off, every output stays byte-identical to a single-engine run.
"""
