"""DDP mechanisms: bucket sizes chosen from a measured all-reduce (:mod:`~.buckets`) and gradient
communication hooks (:mod:`~.comm_hooks`). Pure PyTorch; may import the base modules and
:mod:`lit_parallel.measure`.
"""
