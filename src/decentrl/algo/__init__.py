"""decentrl.algo: advantages, policy losses, off-policy corrections, regularisers.

Imports no role and no torch at package level (its config, `[algorithm]`, is `decentrl.config.algorithm`).
"""
