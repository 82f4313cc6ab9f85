"""Release a run: export a version as a Hugging Face model directory with its provenance, verify
such a directory against the run's signed weight chain, and push it to the Hub."""
