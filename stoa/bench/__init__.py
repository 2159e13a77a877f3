"""Benchmarks that print figures: rollout throughput of the engines against their upstream baselines."""
