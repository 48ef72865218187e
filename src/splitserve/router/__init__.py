"""The session-aware router: sticky decode placement, prefix-aware prefill, failover.

Torch-free by contract: it deploys on machines without torch, and the simulator imports
``router.policies`` directly. Nothing under this package may import torch, the engine or the
models.
"""
