"""`decentrl bench staleness`: the runs (`main.py`), their table (`table.py`), studies pooled (`merge.py`)."""
