"""`decentrl bench throughput`: the demo against an in-process synchronous loop (`sync.py`)."""
