"""Pipeline parallelism without Lightning: the plan that cuts a model into stages at block boundaries
(:mod:`~.plan`), the stage modules (:mod:`~.stage`), running torch's schedules over parallelized stages
(:mod:`~.schedule`) and stage optimizer states in checkpoints (:mod:`~.checkpoint`). May import the rest of
:mod:`lit_parallel.parallel`, :mod:`lit_parallel.checkpoint` and the base modules.
"""
