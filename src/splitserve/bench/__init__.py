"""The benchmark: workloads, trace replay, an async streaming client, SLO goodput, reports.

Torch-free. ``workloads``, ``traces`` and ``metrics`` are also the simulator's inputs and
outputs, so a simulated run and a measured one print the same summary from the same records.
"""
