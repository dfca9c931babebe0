"""Parallel layouts over many devices: TP, PP, DP and EP and their collectives.

``layout`` holds vLLM's flags and rules and the model one rank holds; ``collectives`` prices a
collective from the topology in the device files; ``rank_cost`` prices one rank's step plus the
collectives it waits for (ranks are symmetric, so one is priced, and imbalance enters as the
busiest rank); ``memory`` sizes one rank's memory and its KV pool.
"""
