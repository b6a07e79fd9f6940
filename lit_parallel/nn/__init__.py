"""Modules lit_parallel must provide itself."""
