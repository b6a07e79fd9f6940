"""Tensor parallelism inside transformer blocks: infer a plan, check it, apply it (no Trainer needed).

::

    plan = infer_tp_plan(model, tp_size=2, sequence_parallel=True)
    apply_tp(model, mesh["tensor_parallel"], plan)
    apply_fsdp(model, mesh["data_parallel"])

This module is the public face of the tensor-parallel code, which is split by responsibility:

- :mod:`~lit_parallel.parallel.tensor_parallel.plan`: the plan as data (:class:`TPPlan`, :class:`TPLayer`) and its
  description;
- :mod:`~lit_parallel.parallel.tensor_parallel.infer`: :func:`infer_tp_plan` (traced, else structural) and the
  checks of user plans;
- :mod:`~lit_parallel.parallel.tensor_parallel.families`: per-model-family knowledge, one plan provider per family,
  the generic planner (:mod:`~lit_parallel.parallel.tensor_parallel.block_plan`) last;
- :mod:`~lit_parallel.parallel.tensor_parallel.trace`: recording a forward's data flow, simulating one rank's forward;
- :mod:`~lit_parallel.parallel.tensor_parallel.styles`: the ``ParallelStyle`` of each plan entry (fused column split,
  sequence-parallel norms);
- :mod:`~lit_parallel.parallel.tensor_parallel.apply`: :func:`apply_tp` and sequence-parallel boundaries.
"""

from lit_parallel.parallel.tensor_parallel.apply import apply_tp, local_parameter_bytes
from lit_parallel.parallel.tensor_parallel.infer import PlanSpec, check_tp_plan, infer_tp_plan, plan_from_spec
from lit_parallel.parallel.tensor_parallel.plan import (
    COLWISE,
    COLWISE_FUSED,
    LOSS_PARALLEL_HEAD,
    REPLICATED,
    ROWWISE,
    SEQUENCE_PARALLEL,
    TPLayer,
    TPPlan,
    TPPlanError,
)

__all__ = [
    "COLWISE",
    "COLWISE_FUSED",
    "LOSS_PARALLEL_HEAD",
    "REPLICATED",
    "ROWWISE",
    "SEQUENCE_PARALLEL",
    "PlanSpec",
    "TPLayer",
    "TPPlan",
    "TPPlanError",
    "apply_tp",
    "check_tp_plan",
    "infer_tp_plan",
    "local_parameter_bytes",
    "plan_from_spec",
]
