"""Precision plugins: Lightning's precision flags under FSDP2 (:mod:`~.fsdp`) and under ``pp_dp``
(:mod:`~.pipeline`). May import :mod:`lit_parallel.parallel` and the base modules; strategies import them.
"""
