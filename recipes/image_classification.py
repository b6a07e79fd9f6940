"""Image classification: a small ResNet with BatchNorm, trained data-parallel with ddp_tuned.

Default data: scikit-learn's bundled handwritten digits (1,797 8x8 grey images, no download). Give
``--data.cifar10_dir`` the folder ``cifar-10-batches-py`` (the "CIFAR-10 python version" archive,
extracted) to train on CIFAR-10 instead; the network adapts to the channels and classes of the data.

The configuration (strategy, callbacks, loggers) lives in configs/image_classification.yaml; its header
has the launch commands. Quick start on one machine, 2 CPU processes:

    python recipes/image_classification.py fit --config recipes/configs/image_classification.yaml

What the callbacks in the config do:
- SyncBatchNormConversion: BatchNorm statistics over the global batch (all ranks), on CPU/gloo too;
- CrossRankMetrics: validation accuracy exactly as one process would compute it on the same data;
- SetEpochCheck: every rank reads a different shard, and the order changes each epoch;
- PitfallReport: ranks diverging, learning rate not scaled, data loading or communication bottlenecks.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from training_logs import RecipeCLI, training_flops

import lit_parallel as lp

# --- model ----------------------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a shortcut (He et al., 2016)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """A stem, then one stage per width (the first keeps the resolution, the others halve it)."""

    def __init__(self, in_channels: int, num_classes: int, widths: list[int], blocks_per_stage: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        stages, channels = [], widths[0]
        for i, width in enumerate(widths):
            for j in range(blocks_per_stage):
                stages.append(BasicBlock(channels, width, stride=2 if i > 0 and j == 0 else 1))
                channels = width
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class ImageClassifier(L.LightningModule):
    """Cross-entropy training with SGD + momentum and a cosine schedule; logs loss and accuracy.

    Args:
        in_channels, num_classes: filled in from the data (see ``add_arguments_to_parser``).
        widths: channels of each stage.
        blocks_per_stage: residual blocks per stage.
        lr: learning rate for the global batch (scale it when you change the number of ranks or the
            batch size: ``lp.scaled_learning_rate``; PitfallReport checks it).
        augment: random crops and horizontal flips (on the device, with a different random stream on
            every rank).
    """

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        widths: tuple[int, ...] = (16, 32, 64),
        blocks_per_stage: int = 1,
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        augment: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = ResNet(in_channels, num_classes, list(widths), blocks_per_stage)
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)
        self.augmentation_rng: torch.Generator | None = None
        self.flops_per_batch: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def on_fit_start(self) -> None:
        # Each data-parallel rank draws its own crops and flips (identical ones would waste the extra data).
        seed = lp.per_rank_seed(self.hparams.seed, self.trainer)
        self.augmentation_rng = torch.Generator(self.device).manual_seed(seed)

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        if self.flops_per_batch is None:  # for the throughput log (MFU on GPUs)
            h = self.hparams
            self.flops_per_batch = training_flops(
                lambda: ResNet(h.in_channels, h.num_classes, list(h.widths), h.blocks_per_stage), batch[0]
            )

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        if self.hparams.augment:
            images = random_crop_flip(images, self.augmentation_rng)
        logits = self(images)
        loss = F.cross_entropy(logits, labels)
        self.train_acc(logits, labels)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self.val_acc(logits, labels)
        self.log("val_loss", F.cross_entropy(logits, labels), sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.ndim > 1]
        no_decay = [p for p in self.parameters() if p.ndim <= 1]  # BatchNorm and biases
        optimizer = torch.optim.SGD(
            [
                {"params": decay, "weight_decay": self.hparams.weight_decay},
                {"params": no_decay, "weight_decay": 0},
            ],
            lr=self.hparams.lr,
            momentum=self.hparams.momentum,
            nesterov=True,
        )
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(
            optimizer, self.trainer.estimated_stepping_batches
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def random_crop_flip(images: torch.Tensor, generator: torch.Generator, padding: int = 4) -> torch.Tensor:
    """Random crops (zero padding) and horizontal flips, per image."""
    n, _, h, w = images.shape
    padded = F.pad(images, (padding,) * 4)
    dx = torch.randint(0, 2 * padding + 1, (n,), generator=generator, device=images.device)
    dy = torch.randint(0, 2 * padding + 1, (n,), generator=generator, device=images.device)
    rows = (dy[:, None] + torch.arange(h, device=images.device))[:, None, :, None]
    cols = (dx[:, None] + torch.arange(w, device=images.device))[:, None, None, :]
    batch = torch.arange(n, device=images.device)[:, None, None, None]
    channels = torch.arange(images.shape[1], device=images.device)[None, :, None, None]
    out = padded[batch, channels, rows, cols]
    flip = torch.rand(n, generator=generator, device=images.device) < 0.5
    return torch.where(flip[:, None, None, None], out.flip(-1), out)


# --- data -----------------------------------------------------------------------------------------------


class ImageData(L.LightningDataModule):
    """Digits (default, bundled with scikit-learn) or CIFAR-10 (``cifar10_dir``), normalized per channel.

    Args:
        cifar10_dir: folder with CIFAR-10's ``data_batch_1`` ... ``data_batch_5`` and ``test_batch``
            (python version); ``None`` uses scikit-learn's digits.
        batch_size: per-rank batch size (the global batch is this x the number of data-parallel ranks).
        val_size: digits held out for validation (CIFAR-10 validates on its test batch).
        num_workers: DataLoader worker processes per rank.
    """

    def __init__(
        self, cifar10_dir: str | None = None, batch_size: int = 32, val_size: int = 360, num_workers: int = 0
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.num_channels, self.num_classes = (3, 10) if cifar10_dir else (1, 10)
        self.train: TensorDataset | None = None
        self.val: TensorDataset | None = None

    def setup(self, stage: str) -> None:
        if self.train is not None:
            return
        if self.hparams.cifar10_dir:
            (x_train, y_train), (x_val, y_val) = load_cifar10(Path(self.hparams.cifar10_dir))
        else:
            (x_train, y_train), (x_val, y_val) = load_digits(self.hparams.val_size)
        mean = x_train.mean(dim=(0, 2, 3), keepdim=True)
        std = x_train.std(dim=(0, 2, 3), keepdim=True)
        self.train = TensorDataset((x_train - mean) / std, y_train)
        self.val = TensorDataset((x_val - mean) / std, y_val)

    def train_dataloader(self) -> DataLoader:
        # shuffle=True: Lightning replaces the sampler with a DistributedSampler(shuffle=True) and calls its
        # set_epoch every epoch (SetEpochCheck proves it).
        return DataLoader(
            self.train, batch_size=self.hparams.batch_size, shuffle=True, num_workers=self.hparams.num_workers
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.hparams.batch_size, num_workers=self.hparams.num_workers)


def load_digits(val_size: int):
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError as err:
        raise RuntimeError("the digits data comes with scikit-learn: pip install scikit-learn") from err
    digits = sklearn_digits()
    x = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    val, train = order[:val_size], order[val_size:]
    return (x[train], y[train]), (x[val], y[val])


def load_cifar10(folder: Path):
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"--data.cifar10_dir={str(folder)!r} lacks {', '.join(missing)}; pass the extracted"
            " 'cifar-10-batches-py' folder of https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
        )

    def read(name: str):
        with open(folder / name, "rb") as f:
            entry = pickle.load(f, encoding="latin1")  # noqa: S301  (the dataset's own format)
        x = torch.tensor(entry["data"], dtype=torch.uint8).view(-1, 3, 32, 32).float() / 255.0
        return x, torch.tensor(entry["labels"], dtype=torch.long)

    train = [read(n) for n in names[:5]]
    return (torch.cat([x for x, _ in train]), torch.cat([y for _, y in train])), read("test_batch")


# --- command line ---------------------------------------------------------------------------------------


class ImageCLI(RecipeCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # the network takes its input channels and classes from the data
        parser.link_arguments("data.num_channels", "model.in_channels", apply_on="instantiate")
        parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")


def main(args: list[str] | None = None) -> ImageCLI:
    return ImageCLI(ImageClassifier, ImageData, args=args)


if __name__ == "__main__":
    main()
