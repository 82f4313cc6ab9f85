"""LLM-judge attacks shared by the tests and benchmarks."""
