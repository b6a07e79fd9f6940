"""`lit-parallel bench ep`: fsdp_blocks with expert parallelism vs fsdp_blocks without it, on one MoE model.

Both variants train the same Mixtral-style model (transformers' ``MixtralForCausalLM`` with a small config
built in code, its experts most of the parameters; cross-entropy plus the model's load-balancing loss,
AdamW) on the same data, each rank reading its own samples:

- ``fsdp_blocks``: ``TransformerFSDPStrategy()``: every rank all-gathers every expert of a layer in
  forward and again in backward, and reduce-scatters all their gradients;
- ``fsdp_blocks_ep``: ``TransformerFSDPStrategy(expert_parallel_size=EP)``: each rank holds ``E / EP``
  experts per layer (FSDP-sharded further over the ``N / EP`` ranks holding the same ones) and the tokens
  travel to their experts and back by all-to-all.

Bytes communicated are counted on every rank over one optimizer step (forward, backward, optimizer step:
the last warm-up step) with :class:`~lit_parallel.measure.collectives.CommCounter`, as payload per kind:
all-gather = the gathered tensor, reduce-scatter = the unreduced input, all-to-all = what the rank
receives. Collectives over a group of one rank (FSDP over ``N / EP = 1`` rank) move nothing and are kept
apart. Next to them, the prediction (:data:`FORMULA`): FSDP's bytes from the parameter sizes, the
all-to-all bytes from the routing the rank saw (``strategy.expert_plan.stats``).

Step time is the wall time between consecutive batch ends after the warm-up steps; each repeat gives a
median, the table shows the median over repeats, and the ratio is the median over repeats of the two
variants' ratio (run back to back, in rotated order).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from lit_parallel.commands.extras import require_extra
from lit_parallel.commands.launch import add_worker_arguments

VARIANTS = ("fsdp_blocks", "fsdp_blocks_ep")
KINDS = ("all_gather", "reduce_scatter", "all_to_all")

FORMULA = (
    "per rank and optimizer step, payload bytes (b = bytes per element, 4 in fp32). FSDP over s ranks pads"
    " a tensor's first dimension to a multiple of s: |t|_s = ceil(d0 / s) * s * (other dims) * b."
    " Without EP (s = N): all-gather = sum over block parameters of 2 |t|_N (forward and backward) + sum"
    " over the parameters outside blocks of |t|_N (gathered once: the root group stays gathered into"
    " backward); reduce-scatter = sum over all parameters of |t|_N."
    " With EP: the same for every parameter but the experts; each rank's experts (E/EP of each layer's"
    " [E, ...] weights) add 2 |t_local|_(N/EP) all-gathered and |t_local|_(N/EP) reduce-scattered over the"
    " N/EP ranks holding the same experts (nothing crosses ranks when N/EP = 1)."
    " all-to-all = calls * E * 8 (the per-expert counts, int64, once per MoE layer call) + 2 * (rows_sent"
    " + rows_received) * H * b (dispatch and combine in forward, their gradients in backward: a rank"
    " receives the rows its experts take and its own rows back), rows = (token, expert) pairs."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=int, default=2, help="ranks (processes) to run (default 2)")
    p.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu", help="cpu (gloo) or gpu (nccl)")
    p.add_argument(
        "--expert-parallel-size",
        type=int,
        default=0,
        help="EP degree of fsdp_blocks_ep: divides --devices and --experts (default: --devices)",
    )
    p.add_argument("--hidden", type=int, default=128, help="model width (default 128)")
    p.add_argument("--intermediate", type=int, default=512, help="width inside each expert (default 512)")
    p.add_argument("--experts", type=int, default=8, help="experts per MoE layer (default 8)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    p.add_argument(
        "--layers",
        type=int,
        default=4,
        help="decoder layers (default 4: about 6.8M parameters, 92%% of them in experts)",
    )
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--vocab", type=int, default=1024, help="vocabulary size (default 1024)")
    p.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    p.add_argument("--batch-size", type=int, default=4, help="per-rank batch size (default 4)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per repeat (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per repeat, at least 2 (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="repeats of every variant (default 3)")
    p.add_argument("--out", default="bench-ep", help="folder for the plot ep_bench.png (default bench-ep)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    add_worker_arguments(p)


_FORWARDED = (
    "accelerator",
    "hidden",
    "intermediate",
    "experts",
    "top_k",
    "layers",
    "heads",
    "vocab",
    "seq",
    "batch_size",
    "steps",
    "warmup",
    "repeats",
    "out",
)


def check_arguments(args: argparse.Namespace) -> int:
    """The EP size ``args`` ask for, after checking every size against the others."""
    ep = args.expert_parallel_size or args.devices
    if args.repeats < 1 or args.steps < 1 or args.warmup < 2:
        raise ValueError(
            f"--repeats={args.repeats}, --steps={args.steps}, --warmup={args.warmup}: repeats and steps must be"
            " at least 1 and warmup at least 2 (the last warm-up step is the counted one)"
        )
    if args.devices < 2:
        raise ValueError(f"--devices={args.devices}: expert parallelism needs at least 2 ranks")
    if ep < 2 or args.devices % ep or args.experts % ep:
        raise ValueError(
            f"--expert-parallel-size={ep} must be at least 2 and divide both --devices={args.devices} and"
            f" --experts={args.experts}; choose one of"
            f" {[d for d in range(2, args.devices + 1) if args.devices % d == 0 and args.experts % d == 0]}"
        )
    if not 1 <= args.top_k <= args.experts:
        raise ValueError(f"--top-k={args.top_k} must be between 1 and --experts={args.experts}")
    if args.hidden % args.heads:
        raise ValueError(f"--hidden={args.hidden} must be a multiple of --heads={args.heads}")
    return ep


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return _worker(args)
    ep = check_arguments(args)
    require_extra("moe", "bench ep's Mixtral model")  # both before any rank starts
    require_extra("bench", "the plot bench ep draws")
    from lit_parallel.commands.bench.common import launch_and_report

    if args.json and args.out == "bench-ep":
        args.out = str(Path(args.json).resolve().parent)  # the plot next to the JSON
    forwarded = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in _FORWARDED]
    forwarded += [f"--devices={args.devices}", f"--expert-parallel-size={ep}"]
    return launch_and_report("lit_parallel.commands.bench.ep", args, forwarded, print_report)


def print_report(result: dict[str, Any]) -> None:
    from lit_parallel.commands.terminal import Column, fit_table, terminal_console
    from lit_parallel.formatting import format_bytes

    cfg = result["config"]
    title = (
        f"bench ep: {cfg['params'] / 1e6:.2f}M-parameter Mixtral ({cfg['layers']} layers, {cfg['experts']}"
        f" experts top-{cfg['top_k']}, experts {cfg['expert_fraction']:.0%} of the parameters),"
        f" {cfg['devices']} ranks ({cfg['backend']}), batch {cfg['batch_size']}x{cfg['seq']} tokens/rank,"
        f" AdamW, median of {cfg['repeats']} repeats x {cfg['steps']} steps"
    )
    headers = ("step (ms)", "tokens/s", "vs fsdp_blocks", "params/rank")
    columns = [Column("variant"), Column("experts/rank"), *(Column(h, "right") for h in headers)]
    rows = []
    for name in VARIANTS:
        v = result["variants"][name]
        rows.append(
            [
                name,
                v["experts_per_rank"],
                f"{v['median_step_s'] * 1e3:.1f}",
                f"{v['tokens_per_s']:,.0f}",
                f"{v['ratio_vs_fsdp_blocks']:.3f}",
                format_bytes(v["param_bytes"]),
            ]
        )
    console = terminal_console()
    console.print(fit_table(columns, rows, width=console.width, title=title))
    byte_headers = ("all-gather", "reduce-scatter", "all-to-all", "total", "predicted")
    columns = [Column("variant"), Column("rank", "right"), *(Column(h, "right") for h in byte_headers)]
    rows = []
    for name in VARIANTS:
        for rank, r in enumerate(result["variants"][name]["ranks"]):
            rows.append(
                [
                    name,
                    str(rank),
                    *(format_bytes(r["payload"][k]) for k in KINDS),
                    format_bytes(r["total"]),
                    "exact" if r["matches_prediction"] else format_bytes(r["predicted_total"]),
                ]
            )
    console.print(
        fit_table(columns, rows, width=console.width, title="payload bytes per rank and optimizer step")
    )
    for name in VARIANTS:
        local = result["variants"][name]["ranks"][0]["local"]
        if local:
            console.print(f"{name}: collectives over one rank (no traffic), rank 0: {local}")
    console.print(f"per-repeat medians (s): {result['per_repeat']}")
    for path in result.get("plots", []):
        print(f"wrote {path}")


# ----------------------------------------------------------------------------------------- model


def make_mixtral(args) -> Any:
    """The benchmark's MixtralForCausalLM from ``args``, seeded: identical on every rank."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        output_router_logits=True,
        router_aux_loss_coef=0.02,
        max_position_embeddings=args.seq,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return MixtralForCausalLM(config)


def _lightning_module(args) -> Any:
    import lightning as L
    import torch
    import torch.nn.functional as F

    class MixtralBench(L.LightningModule):
        """Next-token cross-entropy plus the router's load-balancing loss, AdamW."""

        def __init__(self):
            super().__init__()
            self.model = make_mixtral(args)

        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self.model(input_ids=x)
            ce = F.cross_entropy(out.logits.flatten(0, 1).float(), y.flatten())
            return ce + self.model.config.router_aux_loss_coef * out.aux_loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return MixtralBench()


# ----------------------------------------------------------------------------------------- prediction


def predicted_fsdp_bytes(model: Any, devices: int, ep: int) -> dict[str, int]:
    """FSDP's all-gather and reduce-scatter payload per rank and step (see :data:`FORMULA`) for ``model``
    unsplit, under fsdp_blocks over ``devices`` ranks with expert parallelism ``ep`` (1 = none)."""
    import math

    from lit_parallel.parallel.blocks import find_transformer_blocks
    from lit_parallel.parallel.expert_parallel import find_moe_layers

    blocks = [name for name, _ in find_transformer_blocks(model).blocks]
    experts = (
        {n for layer in find_moe_layers(model) for n in layer.expert_parameter_names()} if ep > 1 else set()
    )

    def padded(shape: tuple[int, ...], element: int, ranks: int) -> int:
        rest = math.prod(shape[1:]) if len(shape) > 1 else 1
        return math.ceil(shape[0] / ranks) * ranks * rest * element

    out = {"all_gather": 0, "reduce_scatter": 0}
    for name, p in model.named_parameters():
        shape, element = tuple(p.shape), p.element_size()
        if name in experts:
            edp = devices // ep
            if edp == 1:
                continue  # FSDP over one rank: nothing crosses ranks
            size = padded((shape[0] // ep, *shape[1:]), element, edp)
            gathers = 2
        else:
            size = padded(shape, element, devices)
            gathers = 2 if any(name.startswith(f"{b}.") for b in blocks) else 1
        out["all_gather"] += gathers * size
        out["reduce_scatter"] += size
    return out


def predicted_all_to_all_bytes(exchange: dict[str, int], experts: int, hidden: int, element: int) -> int:
    """All-to-all payload one rank receives in a step, from the routing it saw (see :data:`FORMULA`)."""
    return (
        exchange["calls"] * experts * 8
        + 2 * (exchange["rows_sent"] + exchange["rows_received"]) * hidden * element
    )


# ----------------------------------------------------------------------------------------- ranks


def _worker(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from lit_parallel.commands.bench.common import time_variants, token_dataset
    from lit_parallel.commands.launch import init_ranks, write_result

    use_gpu = init_ranks(args.accelerator).type == "cuda"
    n = dist.get_world_size()
    data = token_dataset(args.vocab, args.seq, n * args.batch_size * (args.warmup + args.steps))
    times, measured = time_variants(
        VARIANTS, args.repeats, args.warmup, lambda variant: _lightning_run(args, data, variant, use_gpu)
    )
    if dist.get_rank() == 0:
        result = _report(args, n, dist.get_backend(), times, {v: m["ranks"] for v, m in measured.items()})
        result["plots"] = [str(plot(result, Path(args.out)))]
        write_result(args.result, result)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _report(
    args: argparse.Namespace,
    n: int,
    backend: str,
    times: dict[str, list[float]],
    ranks: dict[str, list[dict]],
) -> dict[str, Any]:
    """The result: ``times`` (per variant, each repeat's median step) and what every rank counted in the
    counted step (``ranks[variant][rank]``), next to the prediction (:data:`FORMULA`)."""
    import statistics

    from lit_parallel.commands.bench.common import median_ratio
    from lit_parallel.parallel.expert_parallel import expert_parameter_count

    model = make_mixtral(args)
    params = sum(p.numel() for p in model.parameters())
    element = next(model.parameters()).element_size()
    ep = args.expert_parallel_size
    variants = {}
    for v in VARIANTS:
        size = ep if v == "fsdp_blocks_ep" else 1
        fsdp = predicted_fsdp_bytes(model, n, size)
        per_rank = []
        for r in ranks[v]:
            exchange = r["exchange"]
            predicted = {
                **fsdp,
                "all_to_all": predicted_all_to_all_bytes(exchange, args.experts, args.hidden, element),
            }
            per_rank.append(
                {
                    **r,
                    "total": sum(r["payload"].values()),
                    "predicted": predicted,
                    "predicted_total": sum(predicted.values()),
                    # every kind equal, and no collective the prediction leaves out
                    "matches_prediction": r["payload"] == predicted,
                    # the part of the all-to-all rows that leaves or reaches another rank (the rest stays)
                    "all_to_all_rows_crossing_ranks": 2
                    * (exchange["rows_sent_remote"] + exchange["rows_received_remote"])
                    * args.hidden
                    * element,
                }
            )
        median = statistics.median(times[v])
        variants[v] = {
            "expert_parallel_size": size,
            "experts_per_rank": f"{args.experts // size} of {args.experts}, over {n // size} rank(s)",
            "median_step_s": median,
            "tokens_per_s": args.batch_size * args.seq * n / median,
            "ratio_vs_fsdp_blocks": median_ratio(times[v], times["fsdp_blocks"]),
            "param_bytes": ranks[v][0]["param_bytes"],
            # rank 0's payload of every kind together (bench all's "bytes communicated" plot)
            "payload_bytes_per_step": per_rank[0]["total"],
            "ranks": per_rank,
        }
    experts = expert_parameter_count(model)
    config = {"devices": n, "backend": backend, "expert_parallel_size": ep, "params": params}
    config |= {"expert_params": experts, "expert_fraction": experts / params}
    config |= {k: getattr(args, k) for k in ("hidden", "intermediate", "experts", "top_k", "layers", "heads")}
    config |= {k: getattr(args, k) for k in ("vocab", "seq", "batch_size", "steps", "repeats")}
    return {
        "config": config,
        "formula": FORMULA,
        "variants": variants,
        "per_repeat": {v: [round(t, 5) for t in times[v]] for v in VARIANTS},
    }


class _ExchangeProbe:
    """The routing statistics of the counted step (the last warm-up step, as :class:`StepProbe` counts)."""

    def __new__(cls, warmup: int):
        import lightning as L

        from lit_parallel.parallel.expert_parallel import ExchangeStats

        class Probe(L.Callback):
            def __init__(self):
                self.stats = ExchangeStats()

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                plan = getattr(trainer.strategy, "expert_plan", None)
                if batch_idx == warmup - 1 and plan is not None:
                    plan.stats.reset()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                plan = getattr(trainer.strategy, "expert_plan", None)
                if batch_idx == warmup - 1 and plan is not None:
                    self.stats.add(plan.stats)

        return Probe()


def _lightning_run(args, data, variant, use_gpu) -> tuple[list[float], dict]:
    import dataclasses

    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    from lit_parallel import TransformerFSDPStrategy
    from lit_parallel.commands.bench.common import StepProbe, bench_trainer
    from lit_parallel.parallel import local_parameter_bytes

    n = dist.get_world_size()
    size = args.expert_parallel_size if variant == "fsdp_blocks_ep" else 1
    strategy = TransformerFSDPStrategy(expert_parallel_size=size)
    probe, exchange = StepProbe(args.warmup, use_gpu), _ExchangeProbe(args.warmup)
    trainer = bench_trainer(args, strategy, use_gpu, [probe, exchange])
    module = _lightning_module(args)
    sampler = DistributedSampler(data, num_replicas=n, rank=dist.get_rank(), seed=0)
    trainer.fit(module, DataLoader(data, batch_size=args.batch_size, sampler=sampler))
    payload = dict.fromkeys(KINDS, 0)
    local: dict[str, int] = {}
    for record in probe.records:
        if record.group_size > 1:
            payload[record.kind] = payload.get(record.kind, 0) + record.payload_bytes
        else:
            local[record.kind] = local.get(record.kind, 0) + record.payload_bytes
    mine = {
        "payload": payload,
        "local": local,
        "calls": probe.counts,
        "exchange": {k: v for k, v in dataclasses.asdict(exchange.stats).items() if k != "per_expert"},
        "param_bytes": sum(local_parameter_bytes(module).values()),
    }
    ranks: list[Any] = [None] * n
    dist.all_gather_object(ranks, mine)
    return probe.step_times, {"ranks": ranks}


# ----------------------------------------------------------------------------------------- plot


def plot(result: dict[str, Any], out: Path) -> Path:
    """``ep_bench.png``: payload bytes per rank and kind next to the prediction, and the step times."""
    import matplotlib  # the bench extra: run() has checked that it is installed

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    cfg = result["config"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [2.2, 1]})
    colors = {"all_gather": "#4c72b0", "reduce_scatter": "#dd8452", "all_to_all": "#55a868"}
    labels, positions, x = [], [], 0.0
    for v in VARIANTS:
        for rank, r in enumerate(result["variants"][v]["ranks"]):
            bottom = 0.0
            for kind in KINDS:
                mb = r["payload"][kind] / 1e6
                left.bar(
                    x, mb, bottom=bottom, color=colors[kind], label=kind.replace("_", "-") if x == 0 else None
                )
                bottom += mb
            left.plot(
                [x - 0.4, x + 0.4],
                [r["predicted_total"] / 1e6] * 2,
                "k--",
                linewidth=1,
                label="predicted total" if x == 0 else None,
            )
            labels.append(f"{'EP' if v == 'fsdp_blocks_ep' else 'no EP'}\nrank {rank}")
            positions.append(x)
            x += 1
        x += 0.5
    left.set_xticks(positions, labels, fontsize=8)
    left.set_ylim(
        0, 1.12 * max(r["predicted_total"] for v in VARIANTS for r in result["variants"][v]["ranks"]) / 1e6
    )
    left.set_ylabel("MB per optimizer step")
    left.set_title(
        f"payload per rank: fsdp_blocks vs fsdp_blocks + EP {cfg['expert_parallel_size']}", fontsize=9
    )
    left.legend(fontsize=8)
    med = [result["variants"][v]["median_step_s"] * 1e3 for v in VARIANTS]
    right.bar(range(len(VARIANTS)), med, color="#8172b2")
    for i, v in enumerate(VARIANTS):
        reps = [t * 1e3 for t in result["per_repeat"][v]]
        right.plot([i] * len(reps), reps, "ko", markersize=3)
    right.set_xticks(range(len(VARIANTS)), ["fsdp_blocks", f"+ EP {cfg['expert_parallel_size']}"], fontsize=8)
    right.set_ylabel("ms")
    ratio = result["variants"]["fsdp_blocks_ep"]["ratio_vs_fsdp_blocks"]
    right.set_title(f"median step (dots: repeats); EP / no EP = {ratio:.2f}", fontsize=9)
    fig.suptitle(
        f"bench ep: {cfg['params'] / 1e6:.1f}M-parameter Mixtral, {cfg['experts']} experts top-{cfg['top_k']},"
        f" {cfg['devices']} ranks ({cfg['backend']})",
        fontsize=10,
    )
    fig.tight_layout()
    path = out / "ep_bench.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m lit_parallel.commands.bench.ep")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
