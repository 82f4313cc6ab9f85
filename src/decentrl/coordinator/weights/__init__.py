"""Policy weights as the coordinator serves them: snapshots on disk, the peer table, the weight routes."""
