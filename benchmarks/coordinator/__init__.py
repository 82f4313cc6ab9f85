"""`decentrl bench coordinator`: real coordinators (`server.py`) under simulated workers (`load.py`)."""
