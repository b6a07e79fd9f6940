"""`lit-parallel advise`: the command (:mod:`~.command`), the prediction and its printing (:mod:`~.report`),
the measurement of the predicted step on this machine (:mod:`~.measure`, which ranks also run by name), the
costs timed between a strategy's steps (:mod:`~.cost_timers`) and the comparison of both
(:mod:`~.compare`).
"""
