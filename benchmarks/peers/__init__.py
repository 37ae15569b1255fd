"""Peer benchmarks: other frameworks on the same model and task as asyncflow's example."""
