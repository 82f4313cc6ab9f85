"""decentrl.verifier: the trusted role that recomputes a sampled fraction of accepted rollouts'
log-probs and plausibility statistics and posts verdicts (`main.py`, `recompute.py`)."""
