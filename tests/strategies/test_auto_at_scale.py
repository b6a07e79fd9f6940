"""auto_parallel's decisions at scale: 1 to 64 nodes of 8 GPUs of 80 GB, in bf16-mixed, for the recipes' models
and a Llama-70B shape, each shown by a dry run (lit_parallel.strategies.dry_run: the chosen strategy's real
setup on a simulated cluster, in this process) and checked against the advisor's rules worked out here by hand.

The hand formula (docs/how-to/choosing-a-strategy.md): a GPU of 80 GB leaves 80 x 0.9 - 1 = 71 GB usable (10 %
headroom, 1 GB for the CUDA context and NCCL); mixed precision keeps 2 + 2 + 12 = 16 bytes per parameter
(ZeRO's accounting), divided by the ranks a strategy shards over; every rank keeps the activations of its
micro-batch, except that tensor parallelism splits those inside blocks over the devices of a node. The rules
are tried in order and the first that holds wins.

The parameter counts are torch's own (``numel``), the blocks named here by hand; the activations are the
advisor's estimate of one traced forward (one sequence of the model's length,
lit_parallel.planner.activations): the one input of the rules that is a measurement, not a count
(docs/explanations/advise-accuracy.md compares it with real runs). For the Llama-70B shape it is about 65 GB
per rank, which is what decides there.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import pytest
import torch.distributed as dist
from torch import nn

from lit_parallel.planner.activations import estimate_activations
from lit_parallel.strategies.dry_run import dry_run
from tests.harness import REPO_ROOT
from tests.large_models import LLAMA_70B_BLOCK_PARAMS, LLAMA_70B_PARAMS, llama_70b
from tests.scenarios.recipes import recipe_model

DEVICES = 8
NODES = (1, 2, 4, 8, 16, 32, 64)
MEMORY_GB = 80
USABLE = MEMORY_GB * 1e9 * (1 - 0.10) - 1e9  # 71 GB
BYTES = 2 + 2 + 12  # bf16-mixed: parameter, gradient, fp32 master weight and Adam's two moments
COMPUTE = 2  # bf16: what a gathered block's parameters and gradients take per parameter each


@dataclass(frozen=True)
class Model:
    """A model as the rules see it, counted here."""

    name: str
    build: Callable[[], nn.Module]
    blocks: Callable[[nn.Module], list[nn.Module]]  # its transformer blocks, named by hand
    # takes token ids, so the advisor traces a forward (the image model has no example input to trace)
    tokens: bool = True
    experts_per_layer: tuple[int, ...] = ()
    expert_params: int = 0
    pipeline_loss: bool = False  # has the hook pp_dp needs (a plain nn.Module gets the dry run's)


MODELS = {
    "gpt": Model(
        "gpt",
        lambda: recipe_model("gpt_fsdp", "GPTLanguageModel"),
        lambda m: list(m.model.h),
        pipeline_loss=True,
    ),
    "llama": Model(
        "llama", lambda: recipe_model("llama_tp", "LlamaLanguageModel"), lambda m: list(m.model.layers)
    ),
    # 2 MoE layers of 4 experts, each a SwiGLU of dim 64 and hidden 128 (three 64 x 128 matrices)
    "moe": Model(
        "moe",
        lambda: recipe_model("moe_ep", "MoELanguageModel"),
        lambda m: list(m.model.model.layers),
        experts_per_layer=(4, 4),
        expert_params=2 * 4 * 3 * 64 * 128,
    ),
    "image": Model(
        "image",
        lambda: recipe_model("image_classification", "ImageClassifier"),
        lambda m: list(m.model.stages),
        tokens=False,
    ),
    "llama_70b": Model("llama_70b", llama_70b, lambda m: list(m.model.layers), pipeline_loss=True),
}


# the columns of the decision table in docs/how-to/choosing-a-strategy.md (docs/hooks/auto_at_scale.py prints it)
DOC_COLUMNS = {
    "GPT recipe": "gpt",
    "Llama recipe": "llama",
    "MoE recipe": "moe",
    "image recipe": "image",
    "Llama-70B shape": "llama_70b",
}
DOC_PAGE = REPO_ROOT / "docs" / "how-to" / "choosing-a-strategy.md"


@dataclass(frozen=True)
class Counts:
    params: int
    block_params: tuple[int, ...]
    activations: float  # all of one micro-batch's (0 when the advisor cannot trace the model)
    block_activations: float  # those inside blocks
    largest_block_activations: float


@cache
def counts(name: str) -> Counts:
    spec = MODELS[name]
    model = spec.build()
    params = sum(p.numel() for p in model.parameters())
    blocks = spec.blocks(model)
    block_params = tuple(sum(p.numel() for p in b.parameters()) for b in blocks)
    if not spec.tokens:
        return Counts(params, block_params, 0.0, 0.0, 0.0)
    act = estimate_activations(model, precision="bf16-mixed", blocks=blocks)
    return Counts(params, block_params, act.total_bytes, act.block_bytes, act.largest_block_bytes)


@dataclass(frozen=True)
class Expected:
    """The rules' choice, by hand, and the per-rank bytes they assume for it."""

    strategy: str
    rule: int
    state: float
    activations: float
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.state + self.activations <= USABLE


def expected(name: str, nodes: int) -> Expected:
    spec, c = MODELS[name], counts(name)
    world, a = DEVICES * nodes, c.activations
    # 1: the whole state and the activations fit one device
    if BYTES * c.params + a <= USABLE:
        return Expected("ddp_tuned", 1, BYTES * c.params, a)
    # 2: the largest block, gathered with its gradients in bf16, and its activations do not fit
    largest = max(c.block_params)
    if COMPUTE * 2 * largest + c.largest_block_activations > USABLE:
        return _tensor_parallel(c, nodes, rule=2)
    node = BYTES * c.params / DEVICES  # sharded over the devices of one node
    # 3: several nodes, and sharded inside one node it fits
    if nodes > 1 and node + a <= USABLE:
        return Expected("hsdp", 3, node, a)
    # 4: several nodes, and cut into P stages of nodes / P nodes (the fewest that fit) it does
    stages = [p for p in range(2, nodes + 1) if nodes % p == 0 and node / p + a <= USABLE]
    if nodes > 1 and stages:
        p = stages[0]
        if spec.pipeline_loss:
            kwargs = {
                "pipeline_parallel_size": p,
                "microbatches": 4 * p,
                "data_parallel_replicate_size": nodes // p,
            }
            return Expected("pp_dp", 4, node / p, a, kwargs)
        # no pipeline_loss: fsdp_blocks, its experts split as rule 5 would
        return _sharded(spec, c, world, rule=4)
    # 5: experts hold half of the parameters or more, and a size above 1 divides every layer's experts and a node
    if _expert_parallel_size(spec) > 1:
        return _sharded(spec, c, world, rule=5)
    # 6: sharded over every rank it does not fit, tensor parallel inside a node it does
    fsdp = BYTES * c.params / world
    tp = _tensor_parallel(c, nodes, rule=6)
    if fsdp + a > USABLE and tp.fits:
        return tp
    # 7: otherwise
    return Expected("fsdp_blocks", 7, fsdp, a)


def _expert_parallel_size(spec: Model) -> int:
    if not spec.experts_per_layer or spec.expert_params < 0.5 * counts(spec.name).params:
        return 1
    common = math.gcd(*spec.experts_per_layer)
    return max([e for e in range(2, DEVICES + 1) if common % e == 0 and DEVICES % e == 0], default=1)


def _sharded(spec: Model, c: Counts, world: int, rule: int) -> Expected:
    e = _expert_parallel_size(spec)
    # experts / e / (world / e) and the rest / world: the same per rank as FSDP's
    return Expected(
        "fsdp_blocks",
        rule,
        BYTES * c.params / world,
        c.activations,
        {"expert_parallel_size": e} if e > 1 else {},
    )


def _tensor_parallel(c: Counts, nodes: int, rule: int) -> Expected:
    # blocks split over the 8 devices of a node and sharded over the nodes; the rest sharded over the nodes only
    inside = sum(c.block_params)
    state = BYTES * (inside / (DEVICES * nodes) + (c.params - inside) / nodes)
    act = c.block_activations / DEVICES + (c.activations - c.block_activations)
    return Expected("tp_dp", rule, state, act)


@pytest.fixture(autouse=True)
def _no_process_group():
    yield
    assert not dist.is_initialized()  # every dry run destroys the world it simulated


def test_the_counts_are_the_models_own():
    c = counts("llama_70b")
    assert (c.params, c.block_params) == (LLAMA_70B_PARAMS, (LLAMA_70B_BLOCK_PARAMS,) * 80)
    assert (
        c.activations > 60e9
    )  # 2048 tokens, no activation checkpointing: more than a rank's state on 2+ nodes
    moe = MODELS["moe"].build()
    assert MODELS["moe"].expert_params == sum(
        p.numel() for n, p in moe.named_parameters() if ".experts." in n
    )


@pytest.mark.parametrize("nodes", NODES)
@pytest.mark.parametrize("name", list(MODELS))
def test_auto_parallel_chooses_what_the_rules_give_and_the_choice_sets_up(name, nodes):
    want = expected(name, nodes)
    run = dry_run(
        MODELS[name].build,
        "auto_parallel",
        devices=DEVICES,
        num_nodes=nodes,
        precision="bf16-mixed",
        memory_gb=MEMORY_GB,
        ranks="first",
    )
    assert (run.strategy, run.kwargs) == (want.strategy, want.kwargs), run.decision
    assert run.decision.endswith(f"(rule {want.rule})"), run.decision
    assert run.error is None, run.error
    (rank0,) = run.ranks
    # rank 0 holds no more than the rule assumed (FSDP pads uneven shards: under 1 % more); it fits where the
    # rule says it fits, and where the rule is a last resort it does not
    assert rank0.state_bytes <= want.state * 1.01, (rank0.state_bytes, want.state)
    assert (rank0.state_bytes + want.activations <= USABLE) == want.fits, (rank0.state_bytes, want)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_the_decision_table_in_the_docs_is_what_the_rules_give():
    lines = DOC_PAGE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| nodes x GPUs |"))
    head = _cells(lines[start])
    body = [_cells(line) for line in lines[start + 2 :] if line.startswith("|")][: len(NODES)]
    assert head[1 : 1 + len(DOC_COLUMNS)] == list(DOC_COLUMNS)
    assert [row[0] for row in body] == [f"{n} x {DEVICES}" for n in NODES]
    for nodes, row in zip(NODES, body):
        for name, text in zip(DOC_COLUMNS.values(), row[1:]):
            want = expected(name, nodes)
            shown = re.fullmatch(r"`(\w+)(?:\((.*)\))?` \((\d)\)", text)
            assert shown, f"{nodes} x {DEVICES}, {name}: {text!r}"
            kwargs = dict(re.findall(r"(\w+)=(\d+)", shown[2] or ""))
            assert (shown[1], {k: int(v) for k, v in kwargs.items()}, int(shown[3])) == (
                want.strategy,
                want.kwargs,
                want.rule,
            ), f"{nodes} x {DEVICES}, {name}: the page shows {text}"
        # the Llama-70B shape's rank 0: the activations the rule counts, and whether it fits
        want = expected("llama_70b", nodes)
        assert re.fullmatch(rf"[\d.]+ \+ {want.activations / 1e9:.1f} GB: (does not fit|fits)", row[-1]), row[
            -1
        ]
        assert row[-1].endswith(": fits") == want.fits, row[-1]
