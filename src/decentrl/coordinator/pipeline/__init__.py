"""One rollout's way through the coordinator: leasing, ingestion and rewards, batching for the trainer."""
