"""Benchmarks run by ``lit-parallel bench NAME``: programs that time, never tests."""
