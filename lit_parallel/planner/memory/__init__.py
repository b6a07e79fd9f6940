"""Per-rank peak memory of one training step under each strategy: ZeRO's accounting of the model state
(:mod:`~.table`), the data-parallel strategies' moments (:mod:`~.peak`), ``tp_dp``'s one-rank model
(:mod:`~.tensor_parallel`), ``pp_dp``'s stages (:mod:`~.pipeline`, :mod:`~.pipeline_simulation`), all of them
at once (:mod:`~.predict`); and the host copy an asynchronous checkpoint keeps per rank (:mod:`~.host_copy`).
May import the rest of the planner but :mod:`~lit_parallel.planner.rules`.
"""
