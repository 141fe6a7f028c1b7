"""Benchmark smoke fixtures: ``tiny_models`` (a --tiny bootstrap) lives in tests/conftest.py."""
