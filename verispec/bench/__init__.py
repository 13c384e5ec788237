"""Benchmarks. Speed claims come from here, never from timed unit tests."""
