"""The benchmark: an async streaming client that plays ``splitserve.workload`` sessions
against an endpoint, and ``bench compare``, which starts deployments and runs them side by
side. Torch-free."""
