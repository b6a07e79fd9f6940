"""Checkpoints with every rank's RNG states, written under a temporary name and committed when complete."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from typing_extensions import override

from lit_parallel.checkpoint import (
    LIGHTNING_META,
    atomic_save,
    check_replaceable,
    commit,
    dcp_load,
    new_partial_path,
    verify_checkpoint,
)
from lit_parallel.reliability.options import RNG_KEY, _info
from lit_parallel.rng import capture_rng_state


class _CheckpointReliability:
    """The checkpoint half of :class:`~lit_parallel.reliability.ReliabilityMixin`."""

    def _gather_rng_states(self) -> list[dict] | None:
        state = capture_rng_state()
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return [state]
        gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(state, gathered, dst=0)
        return gathered

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        self._progress.at(f"saving the checkpoint {str(filepath)!r} ({self._progress.describe()})")
        states = self._gather_rng_states()
        if states is not None:
            checkpoint[RNG_KEY] = {"world_size": len(states), "ranks": states}
        if _is_remote(filepath):
            return super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]
        from lightning.pytorch.strategies import ModelParallelStrategy

        if isinstance(self, ModelParallelStrategy):
            return self._save_model_parallel_checkpoint(checkpoint, filepath, storage_options)
        if self.is_global_zero:
            check_replaceable(filepath)
            atomic_save(
                lambda tmp: self.checkpoint_io.save_checkpoint(
                    checkpoint, tmp, storage_options=storage_options
                ),
                filepath,
            )
        return None

    def _save_model_parallel_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None
    ) -> None:
        """``ModelParallelStrategy.save_checkpoint`` written under a temporary name: Lightning's ``meta.pt``
        first, then the shards, then DCP's ``.metadata`` (last, by DCP), then the rename into place."""
        from lightning.fabric.strategies.model_parallel import _distributed_checkpoint_save

        if storage_options is not None:
            raise TypeError(
                f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported because"
                f" `{type(self).__name__}` does not use the `CheckpointIO`."
            )
        path = Path(self.broadcast(str(filepath)))
        check_replaceable(path)
        if not self._save_distributed_checkpoint:
            if self.is_global_zero:
                atomic_save(lambda tmp: self.checkpoint_io.save_checkpoint(checkpoint, tmp), path)
            return
        token = self.broadcast(uuid.uuid4().hex[:12] if self.is_global_zero else None)
        partial = new_partial_path(path, token)
        if self.is_global_zero:
            partial.mkdir(parents=True)
        self.barrier()
        converted = {"state_dict": checkpoint.pop("state_dict")}
        converted.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        try:
            if self.is_global_zero:
                torch.save(checkpoint, partial / LIGHTNING_META)
            _distributed_checkpoint_save(converted, partial)
            self.barrier()
        except BaseException:
            if self.is_global_zero:
                import shutil

                shutil.rmtree(partial, ignore_errors=True)
            raise
        if self.is_global_zero:
            commit(partial, path)
        self.barrier()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        from lightning.pytorch.strategies import ModelParallelStrategy

        self._progress.at(f"restoring the checkpoint {str(checkpoint_path)!r}")
        path = checkpoint_path
        if not _is_remote(path):
            path = Path(self.broadcast(str(path)))
            kind = verify_checkpoint(path)
        else:
            kind = "remote"
        if weights_only is None:
            weights_only = True  # never unpickle code from a checkpoint unless asked to
        if isinstance(self, ModelParallelStrategy) and kind == "sharded":
            checkpoint = self._load_sharded_checkpoint(Path(path))
        else:
            checkpoint = super().load_checkpoint(path, weights_only=weights_only)  # type: ignore[misc]
        self._take_rng_states(checkpoint)
        return checkpoint

    def _load_sharded_checkpoint(self, path: Path) -> dict[str, Any]:
        """Lightning's sharded load, with DCP's index and non-tensor entries read without unpickling code."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        module = self.model
        assert module is not None and self.lightning_module is not None
        module_state = {"state_dict": get_model_state_dict(module)}
        dcp_load(module_state, path)
        module.load_state_dict(module_state["state_dict"], strict=self.lightning_module.strict_loading)
        for i, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{i}"
            optim_state = {key: get_optimizer_state_dict(module, optimizer)}
            dcp_load(optim_state, path)
            set_optimizer_state_dict(
                module,
                optimizer,
                optim_state_dict=optim_state[key],
                options=StateDictOptions(cpu_offload=True),
            )
        return torch.load(path / LIGHTNING_META, weights_only=True)

    def _take_rng_states(self, checkpoint: dict[str, Any]) -> None:
        from lightning.pytorch.trainer.states import TrainerFn

        entry = checkpoint.get(RNG_KEY)
        trainer = self._trainer_or_none()
        if entry is None or trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return  # evaluation keeps the RNG the user seeded
        if entry["world_size"] != self.world_size:
            _info(
                f"the checkpoint holds the RNG states of {entry['world_size']} ranks and this run has"
                f" {self.world_size}: RNG states are not restored, so dropout masks and random augmentations"
                " differ from an uninterrupted run"
            )
            return
        self._rng_at_resume = entry["ranks"][self.global_rank]


def _is_remote(path: Any) -> bool:
    return "://" in str(path)
