"""`decentrl bench weights`: the delta codec on a real run; the peer fan-out (`fanout.py`)."""
