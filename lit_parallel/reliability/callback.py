"""The training-loop side of reliability: a callback each lit_parallel strategy adds to its Trainer. It finds
the strategy's :class:`~lit_parallel.reliability.core.Reliability` as ``trainer.strategy.reliability``."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn

from lit_parallel import _compat
from lit_parallel.reliability.checkpoints import gather_rng_states, rng_states_to_restore
from lit_parallel.reliability.options import RNG_KEY
from lit_parallel.rng import restore_rng_state

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lit_parallel.reliability.core import Reliability


def _reliability(trainer: pl.Trainer) -> Reliability | None:
    from lit_parallel.reliability.core import Reliability

    found = getattr(trainer.strategy, "reliability", None)
    return found if isinstance(found, Reliability) else None


class ReliabilityCallback(Callback):
    """Progress markers for failure and stall reports, the check that a loss reaches the model, preemption at
    optimizer-step boundaries, and every rank's RNG states in checkpoints."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        r = _reliability(trainer)
        if r is None:
            return
        p = r.progress
        p.batch, p.epoch = batch_idx, trainer.current_epoch
        p.at("training_step")
        if r.rng_at_first_batch is not None:
            # mid-epoch resume: the dataloader's iterator drew from the RNG after the checkpoint's state was
            # restored; an uninterrupted run drew at the start of the epoch, before the checkpoint
            restore_rng_state(r.rng_at_first_batch)
            r.rng_at_first_batch = None
        r.clock.step_begins()

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        r = _reliability(trainer)
        if r is None:
            return
        if trainer.world_size > 1 and not _reaches_a_parameter(loss):
            # backward would run without touching the model, so this rank would skip the gradient collectives
            # the other ranks wait in: a silent deadlock. Cheap to detect here.
            raise RuntimeError(
                f"rank {trainer.global_rank}: the loss of training batch {r.progress.batch} (epoch"
                f" {r.progress.epoch}) was not computed from the model's parameters, so its backward would skip"
                " the gradient collectives the other ranks wait in. Every rank must backpropagate through the"
                " model on every batch; to drop a batch's contribution on some ranks, return `loss * 0.0`"
                " instead of a new tensor."
            )
        r.progress.at("backward")

    def on_after_backward(self, trainer, pl_module) -> None:
        r = _reliability(trainer)
        if r is not None:
            r.progress.backward_calls += 1
            r.progress.at("after backward (gradient clipping, optimizer step)")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        r = _reliability(trainer)
        if r is not None:
            r.progress.optimizer_steps += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        r = _reliability(trainer)
        if r is None:
            return
        r.clock.step_ends()
        r.progress.at(
            f"after training batch {batch_idx} (epoch {trainer.current_epoch}): callbacks, loading the next batch"
        )
        if r.preemption is not None and not _compat.should_accumulate(trainer):
            r.preemption.check(trainer, r.progress.batch)

    def on_validation_start(self, trainer, pl_module) -> None:
        r = _reliability(trainer)
        if r is not None:
            r.clock.pause("validation")

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        r = _reliability(trainer)
        if r is not None:
            r.progress.at("validation_step")

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        r = _reliability(trainer)
        if r is not None:
            r.progress.at(f"end of epoch {trainer.current_epoch}")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        # runs on every rank (Lightning builds the checkpoint on each), so the states can be gathered here
        r = _reliability(trainer)
        if r is None:
            return
        r.progress.saving()
        r.clock.pause("saving a checkpoint")
        states = gather_rng_states()
        if states is not None:
            checkpoint[RNG_KEY] = {"world_size": len(states), "ranks": states}

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        r = _reliability(trainer)
        if r is None or trainer.state.fn != TrainerFn.FITTING:
            return  # evaluation keeps the RNG the user seeded
        state = rng_states_to_restore(checkpoint, trainer.world_size, trainer.global_rank)
        if state is not None:
            r.rng_at_resume = state  # applied when Lightning's restore ends (see Reliability.after_barrier)

    def teardown(self, trainer, pl_module, stage) -> None:
        # Lightning's signal connector puts back the handlers it found (ours) after the strategy's teardown
        r = _reliability(trainer)
        if r is not None and r.retired_preemption is not None:
            r.retired_preemption.uninstall()
            r.retired_preemption = None
        if r is not None and r.retired_signals is not None:
            r.retired_signals.uninstall_retired()
            r.retired_signals = None


def _reaches_a_parameter(loss: torch.Tensor, budget: int = 20_000) -> bool:
    """Whether backward from ``loss`` can reach a parameter (an ``nn.Parameter`` leaf, or a custom autograd
    function that may hide one, such as reentrant activation checkpointing). Breadth-first from the loss: a
    model's output layer is a few nodes away, so this stops early; only a loss built from fresh tensors
    (``torch.zeros(1, requires_grad=True)``) explores its whole, tiny graph and returns ``False``."""
    from torch.autograd.function import BackwardCFunction

    fn = loss.grad_fn
    if fn is None:
        return isinstance(loss, torch.nn.Parameter)
    seen = {fn}
    queue = collections.deque([fn])
    while queue:
        node = queue.popleft()
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.nn.Parameter) or isinstance(node, BackwardCFunction):
            return True
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                if len(seen) >= budget:
                    return True  # too large to be a loss computed from nothing
                seen.add(nxt)
                queue.append(nxt)
    return False
