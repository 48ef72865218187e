"""The cluster simulator: the real scheduler, block manager and routing policies at scale."""
