"""Weight publication: snapshots now; manifests, signed deltas and P2P transfer come next."""
