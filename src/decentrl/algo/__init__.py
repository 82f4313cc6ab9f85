"""decentrl.algo: advantages, policy losses, off-policy corrections, regularisers.

Imports no role and no torch at package level, so `algo.config` loads with the coordinator.
"""
