"""`decentrl bench pipeline`: pipeline stages over loopback HTTP with added latency (`delay_proxy.py`)."""
