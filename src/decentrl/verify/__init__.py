"""Trust in workers: identities and signed requests, replay and rate limits, recomputation of claimed
log-probs, the sampling-plausibility test, and the verifier role (docs/security.md)."""
