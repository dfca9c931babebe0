"""Parallel layouts over many devices: the room for TP, PP, DP and EP and their collectives.

Empty until the "many devices" work lands (the design card's Round 3 is the plan). What goes
here: a layout that shards a model's per-layer operators over the ranks of one instance
and says which collectives each step adds; ranks are symmetric, so the simulator prices one
rank plus the collectives, and imbalance enters as the busiest rank (EP routing skew, DP
padding). A collective is priced from the topology in the device files: latency + bytes /
bandwidth, times the algorithm's factor, on the slowest link its group spans.
"""
