"""Continuous batching over a paged KV cache.

``step() = scheduler.schedule() -> model_runner.execute(plan) -> scheduler.update(plan, result)``.
The scheduler and block manager are pure Python (no torch); the model runner owns every tensor.
"""
