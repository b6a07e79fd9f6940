"""The planner: per-rank memory and step time of every strategy, predicted before any run, and the rule
table that picks a strategy (``advise``, ``auto_parallel``).

Pure PyTorch, no Lightning. May import the base modules, :mod:`lit_parallel.measure`,
:mod:`lit_parallel.checkpoint` and the mechanisms (:mod:`lit_parallel.parallel`: it predicts what they do);
the mechanisms never import the planner. Inside: :mod:`~.rules` (the decision table) on top, then
:mod:`~.memory` and :mod:`~.time`, then what both build on (:mod:`~.simulation`, :mod:`~.pipeline_layout`,
:mod:`~.activations`, :mod:`~.model_summary`, :mod:`~.precision`, :mod:`~.fused_attention`).
"""
