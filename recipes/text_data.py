"""Byte-level text for the language-model recipes: every byte is a token (vocabulary 256).

No tokenizer and no download: the default corpus is the source code of a fixed list of modules of
Python's standard library, which every Python installation has. Pass ``--data.path`` to train on your
own text file (any encoding: bytes are bytes).
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

# Plain-text modules of the standard library present in every CPython install.
STDLIB_MODULES = (
    "argparse",
    "dataclasses",
    "functools",
    "inspect",
    "pathlib",
    "typing",
    "collections",
    "json.decoder",
    "json.encoder",
    "logging",
    "textwrap",
    "difflib",
    "fractions",
    "calendar",
)


def stdlib_corpus() -> bytes:
    """The source of :data:`STDLIB_MODULES`, concatenated (about 1.3 MB with CPython 3.11)."""
    parts = []
    for name in STDLIB_MODULES:
        source = inspect.getsourcefile(importlib.import_module(name))
        if source is None:
            raise RuntimeError(
                f"the standard library module {name!r} ships without its source here; pass --data.path=FILE"
            )
        parts.append(Path(source).read_bytes())
    return b"\n".join(parts)


class ByteWindows(Dataset):
    """Non-overlapping windows of ``block_size + 1`` bytes: ``(input, target)`` shifted by one byte."""

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        if len(data) <= block_size:
            raise ValueError(f"the text has {len(data)} bytes, not more than block_size={block_size}")
        self.data, self.block_size = data, block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.block_size : (i + 1) * self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


class ByteTextData(L.LightningDataModule):
    """Windows of a byte stream; the last ``val_fraction`` of the text validates.

    Args:
        path: a text file; ``None`` uses the standard library's source code (offline, on every machine).
        block_size: tokens (bytes) per sample; linked to the model's context length.
        batch_size: samples per rank and step.
        val_fraction: share of the text held out (its end).
        max_bytes: use only the first ``max_bytes`` of the text (quick runs).
        num_workers: DataLoader worker processes per rank.
    """

    vocab_size = 256

    def __init__(
        self,
        path: str | None = None,
        block_size: int = 128,
        batch_size: int = 16,
        val_fraction: float = 0.1,
        max_bytes: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction={val_fraction} must be between 0 and 1")
        self.save_hyperparameters()
        self.train: ByteWindows | None = None
        self.val: ByteWindows | None = None

    def setup(self, stage: str) -> None:
        if self.train is not None:
            return
        if self.hparams.path:
            path = Path(self.hparams.path)
            if not path.is_file():
                raise FileNotFoundError(f"--data.path={str(path)!r} is not a file")
            raw = path.read_bytes()
        else:
            raw = stdlib_corpus()
        if self.hparams.max_bytes:
            raw = raw[: self.hparams.max_bytes]
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        split = int(len(data) * (1 - self.hparams.val_fraction))
        self.train = ByteWindows(data[:split], self.hparams.block_size)
        self.val = ByteWindows(data[split:], self.hparams.block_size)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train, batch_size=self.hparams.batch_size, shuffle=True, num_workers=self.hparams.num_workers
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.hparams.batch_size, num_workers=self.hparams.num_workers)
