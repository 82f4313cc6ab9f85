"""`decentrl bench swarm`: 10,000 workers simulated (`simulation.py`, `fleet.py`, `bandwidth.py`)."""
