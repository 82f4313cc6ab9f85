"""The coordinator's durable state: the schema and its migrations (`schema.py`), the store (`store.py`)."""
