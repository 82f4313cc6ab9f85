"""Verifiable rewards computed on the trusted side (the coordinator), never taken from a worker."""
