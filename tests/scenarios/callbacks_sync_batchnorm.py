"""Synchronized BatchNorm on gloo: the layer alone, and whole training runs with SyncBatchNormConversion."""

from __future__ import annotations

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from lit_parallel.callbacks import ParallelTrainingWarning, SyncBatchNormConversion, data_parallel_group
from lit_parallel.callbacks.sync_batchnorm import running_stats_disagreement
from lit_parallel.nn import SyncBatchNorm
from tests.scenarios.callbacks_common import captured_warnings, make_trainer

# (BatchNorm class, per-sample shape, per-rank batch sizes of step 1 and step 2)
LAYER_CASES = {
    "bn1d_flat_uneven": (torch.nn.BatchNorm1d, (5,), [(5, 3), (2, 6)]),
    "bn1d_seq_even": (torch.nn.BatchNorm1d, (3, 7), [(4, 4), (4, 4)]),
    "bn2d_uneven": (torch.nn.BatchNorm2d, (3, 4, 5), [(3, 1), (4, 2)]),
    "bn2d_empty_rank": (torch.nn.BatchNorm2d, (2, 3, 3), [(4, 0), (3, 2)]),
    "bn3d_cumulative": (torch.nn.BatchNorm3d, (2, 2, 3, 2), [(2, 3), (3, 2)]),
}


def layer_inputs(case: str, seed: int = 0) -> dict:
    """Per step: the global batch, the upstream gradient, and where each rank's part starts and ends."""
    cls, shape, steps = LAYER_CASES[case]
    g = torch.Generator().manual_seed(seed)
    out = {"steps": [], "eval_x": torch.randn(4, *shape, generator=g) * 2 + 1}
    for sizes in steps:
        n = sum(sizes)
        x = torch.randn(n, *shape, generator=g) * 3 + 0.5
        grad = torch.randn(n, *shape, generator=g)
        bounds = [(sum(sizes[:r]), sum(sizes[: r + 1])) for r in range(len(sizes))]
        out["steps"].append((x, grad, bounds))
    channels = shape[0]
    out["weight"] = 1 + 0.2 * torch.randn(channels, generator=g)
    out["bias"] = 0.3 * torch.randn(channels, generator=g)
    out["momentum"] = None if case.endswith("cumulative") else 0.1
    return out


def make_bn(case: str, inputs: dict, cls=None) -> torch.nn.Module:
    bn_cls = cls or LAYER_CASES[case][0]
    channels = LAYER_CASES[case][1][0]
    bn = bn_cls(channels, momentum=inputs["momentum"])
    with torch.no_grad():
        bn.weight.copy_(inputs["weight"])
        bn.bias.copy_(inputs["bias"])
    return bn


def layer_parity(ctx) -> dict:
    """Each rank runs its part of every step through SyncBatchNorm; the test compares with one process."""
    rank = dist.get_rank()
    results = {}
    for case in LAYER_CASES:
        inputs = layer_inputs(case)
        bn = SyncBatchNorm.convert_sync_batchnorm(make_bn(case, inputs))
        assert isinstance(bn, SyncBatchNorm)
        steps = []
        for x, grad, bounds in inputs["steps"]:
            lo, hi = bounds[rank]
            xr = x[lo:hi].clone().requires_grad_(True)
            bn.zero_grad(set_to_none=True)
            y = bn(xr)
            (y * grad[lo:hi]).sum().backward()
            steps.append(
                {
                    "y": y.detach(),
                    "x_grad": xr.grad.detach(),
                    "weight_grad": bn.weight.grad.detach().clone(),
                    "bias_grad": bn.bias.grad.detach().clone(),
                }
            )
        bn.eval()
        # the epoch-end check of SyncBatchNormConversion: silent while synchronized, names a drifted layer
        dp = data_parallel_group(None)
        agree = running_stats_disagreement(torch.nn.Sequential(bn), dp)
        with torch.no_grad():
            bn.running_mean[0] += rank  # rank 1 drifts
        drift = running_stats_disagreement(torch.nn.Sequential(bn), dp)
        with torch.no_grad():
            bn.running_mean[0] -= rank
        results[case] = {
            "agree": agree,
            "drift": drift,
            "steps": steps,
            "running_mean": bn.running_mean.clone(),
            "running_var": bn.running_var.clone(),
            "num_batches_tracked": int(bn.num_batches_tracked),
            "eval_y": bn(inputs["eval_x"]).detach(),
        }
    return results


# ---------------------------------------------------------------------------------- training runs
LR = 0.1
PER_RANK_BATCH = 4
STEPS = 3


class ConvBlock(torch.nn.Module):
    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.conv = torch.nn.Conv2d(c_in, c_out, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(c_out)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


def conv_net() -> torch.nn.Module:
    """Two blocks of one class (which fsdp_blocks shards one by one) and a BatchNorm1d head."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        ConvBlock(3, 4),
        ConvBlock(4, 4),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 6 * 6, 8),
        torch.nn.BatchNorm1d(8),
        torch.nn.Linear(8, 1),
    )


def conv_data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(16, 3, 6, 6, generator=g), torch.randn(16, 1, generator=g))


def conv_loss(net, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(net(x), y)


class ConvModule(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = conv_net()

    def training_step(self, batch, batch_idx):
        return conv_loss(self.net, batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


class ConfigureModelConvModule(ConvModule):
    """Builds its layers in configure_model, after the callbacks' setup: converted there too."""

    def __init__(self):
        L.LightningModule.__init__(self)

    def configure_model(self):
        if not hasattr(self, "net"):
            self.net = conv_net()


def _full_state(module: torch.nn.Module) -> dict:
    out = {}
    for name, value in module.state_dict().items():
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        out[name] = value.detach().cpu().clone()
    return out


def training_parity(ctx) -> dict:
    """Train the BatchNorm net under each strategy with SyncBatchNormConversion; return the final state."""
    out = {}
    for name in ctx.args["strategies"]:
        # global batch 8: below the default minimum of 16 (warned), above 8 for ddp_tuned (silent)
        strategy, callbacks = name, [SyncBatchNormConversion(min_batch_size=8 if name == "ddp_tuned" else 16)]
        if name == "fsdp_blocks":
            from lit_parallel import TransformerFSDPStrategy

            strategy = TransformerFSDPStrategy(block_types={"ConvBlock"})
        elif name == "hsdp":
            from lit_parallel import HybridShardStrategy

            strategy = HybridShardStrategy(shard_size=1, block_types={"ConvBlock"})  # 2 replicas of 1 shard
        elif name == "ddp_plain_batchnorm":
            strategy, callbacks = "ddp", []
        model = ConfigureModelConvModule() if name == "ddp_configure_model" else ConvModule()
        if name == "ddp_configure_model":
            strategy = "ddp"
        trainer = make_trainer(ctx, strategy=strategy, callbacks=callbacks, max_steps=STEPS, max_epochs=-1)
        with captured_warnings(ParallelTrainingWarning) as caught:
            trainer.fit(model, DataLoader(conv_data(), batch_size=PER_RANK_BATCH, shuffle=True))
        layer_types = sorted({type(m).__name__ for m in model.modules() if "BatchNorm" in type(m).__name__})
        out[name] = {
            "state": _full_state(model.net),
            "converted": callbacks[0].converted if callbacks else 0,
            "layer_types": layer_types,
            "warnings": caught,
        }
    return out
