"""What every section of the device check shares: where it runs (CUDA, or the CPU in a dry run), the GPT
recipe model at the section's size, its data, a plain LightningModule around it, and the per-step probe.

A dry run (``--dry-run``) executes every section on the CPU with gloo and tiny sizes, so a section that is
miswired fails here, in ``make test``, and not in the few minutes a GPU is lent.
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "recipes"))

from gpt import GPT, GPTConfig  # noqa: E402  (the recipe's model, recipes/gpt.py)


@dataclass(frozen=True)
class Where:
    """The device a section runs on and the sizes it uses there."""

    dry: bool
    tmp: Path

    @property
    def cuda(self) -> bool:
        return not self.dry

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0) if self.cuda else torch.device("cpu")

    @property
    def accelerator(self) -> str:
        return "gpu" if self.cuda else "cpu"

    @property
    def backend(self) -> str:
        return "nccl" if self.cuda else "gloo"

    def config(self, large: bool = False) -> GPTConfig:
        """The recipe's GPT: GPT-2 small for throughput, a few MB for correctness, a toy in a dry run."""
        if self.dry:
            return GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)
        if large:
            return GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024)
        return GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=128)

    def batch_size(self, large: bool = False) -> int:
        return 2 if self.dry else (8 if large else 8)


def token_data(cfg: GPTConfig, samples: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (samples, cfg.block_size + 1), generator=g)
    return TensorDataset(x[:, :-1].contiguous(), x[:, 1:].contiguous())


def loader(cfg: GPTConfig, samples: int, batch_size: int, seed: int = 0) -> DataLoader:
    return DataLoader(token_data(cfg, samples, seed), batch_size=batch_size, shuffle=False)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


class GPTModule(L.LightningModule):
    """The recipe's GPT under a minimal LightningModule: AdamW (the planner's optimizer), losses recorded.

    ``meta=True`` builds the model on the meta device in ``configure_model`` (the strategy materialises it).
    """

    def __init__(self, cfg: GPTConfig, lr: float = 1e-3, meta: bool = False, seed: int = 0):
        super().__init__()
        self.cfg, self.lr, self.meta, self.seed = cfg, lr, meta, seed
        self.model: GPT | None = None
        if not meta:
            torch.manual_seed(seed)
            self.model = GPT(cfg)
        self.losses: list[torch.Tensor] = []
        self.micro_losses: list[torch.Tensor] = []  # under pp_dp, which calls pipeline_loss per micro-batch

    def configure_model(self) -> None:
        if self.model is None:
            with torch.device("meta"):
                self.model = GPT(self.cfg)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def on_train_batch_start(self, batch, batch_idx):
        self.micro_losses.clear()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.micro_losses:  # pp_dp: the step's loss is the mean of its (equal) micro-batches' losses
            self.losses.append(torch.stack(self.micro_losses).mean())

    def training_step(self, batch, batch_idx):
        loss = lm_loss(self.model(batch[0]), batch[1])
        self.losses.append(loss.detach())  # read once the run has ended: no host sync per step
        return loss

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(logits, targets)
        self.micro_losses.append(loss.detach())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def loss_values(self) -> list[float]:
        return [float(x) for x in self.losses]


def trainer(where: Where, **kwargs: Any) -> L.Trainer:
    base = dict(
        accelerator=where.accelerator,
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    base.update(kwargs)
    return L.Trainer(**base)


class StepPeaks(L.Callback):
    """Per training batch: the CUDA allocator's peak (reset at the batch's start) and the wall time; the
    peak of setup (everything before the first batch, the model's move and sync included)."""

    def __init__(self, where: Where):
        self.where = where
        self.peaks: list[int] = []
        self.times: list[float] = []
        self.setup_peak: int | None = None
        self._start = 0.0

    def on_train_start(self, trainer, pl_module):
        if self.where.cuda:
            torch.cuda.synchronize()
            self.setup_peak = torch.cuda.max_memory_allocated()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.where.cuda:
            torch.cuda.reset_peak_memory_stats()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.where.cuda:
            torch.cuda.synchronize()
            self.peaks.append(torch.cuda.max_memory_allocated())
        self.times.append(time.perf_counter() - self._start)


@contextmanager
def cuda_sync_warnings(where: Where, into: list[str]):
    """Every device synchronisation CUDA sees inside the block (``torch.cuda.set_sync_debug_mode``), as the
    warnings' first lines; nothing on the CPU."""
    if not where.cuda:
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    into.extend(str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message))


def model_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def largest_block_bytes(model: GPT) -> int:
    return max(model_bytes(b) for b in model.h)


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def finite(xs: list[float]) -> bool:
    return all(math.isfinite(x) for x in xs)
