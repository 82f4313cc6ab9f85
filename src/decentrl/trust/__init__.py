"""Trust in workers, the library the coordinator and the workers share: identities and signed
requests, replay and rate limits, the sampling-plausibility test, repeated completions
(docs/security.md). The verifier role lives in `decentrl.verifier`."""
