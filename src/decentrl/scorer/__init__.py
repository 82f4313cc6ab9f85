"""The trusted reward scorer role: reward-model scores for the coordinator (`main.py`)."""
