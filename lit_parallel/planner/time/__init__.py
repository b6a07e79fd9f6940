"""Step time of one training step: one block timed here and scaled by counted ops and FLOPs (:mod:`~.step`),
``pp_dp``'s schedule over its stages (:mod:`~.pipeline`), what each strategy adds measured on tiny models
(:mod:`~.calibration`). May import the planner's shared modules, not :mod:`~lit_parallel.planner.memory`
or :mod:`~lit_parallel.planner.rules`.
"""
