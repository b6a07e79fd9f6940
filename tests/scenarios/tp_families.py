"""Tensor parallelism on Hugging Face model families, run on real gloo ranks by tests/parallel/tensor_parallel/test_families.py.

Each family is a tiny config built in code (no downloads). The scenario splits it with
``infer_tp_plan`` + ``apply_tp`` (no Trainer), runs one forward and backward on a fixed batch and returns
the loss, every parameter's full gradient and what each rank holds of every split layer; the test runs
the same unsplit model in one plain process and compares.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from lit_parallel.parallel import ParallelDims, apply_tp, infer_tp_plan
from lit_parallel.parallel.tensor_parallel.plan import fused_permutation

VOCAB, SEQ, BATCH = 64, 8, 2


def _tiny(cls_name: str, config_name: str, **kw) -> nn.Module:
    import transformers

    config = getattr(transformers, config_name)(**kw)
    return getattr(transformers, cls_name)(config)


_DECODER = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=32,
)

FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "gpt2": lambda: _tiny(
        "GPT2LMHeadModel", "GPT2Config", n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=16
    ),
    "llama": lambda: _tiny("LlamaForCausalLM", "LlamaConfig", **_DECODER),
    "mistral": lambda: _tiny("MistralForCausalLM", "MistralConfig", **_DECODER),
    "qwen2": lambda: _tiny("Qwen2ForCausalLM", "Qwen2Config", **_DECODER),
    "opt": lambda: _tiny(
        "OPTForCausalLM",
        "OPTConfig",
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        word_embed_proj_dim=32,
    ),
    "bert": lambda: _tiny(
        "BertForMaskedLM",
        "BertConfig",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=32,
    ),
    "vit": lambda: _tiny(
        "ViTForImageClassification",
        "ViTConfig",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=8,
        patch_size=4,
        num_channels=3,
        num_labels=3,
    ),
    "t5": lambda: _tiny(
        "T5ForConditionalGeneration",
        "T5Config",
        d_model=32,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        d_kv=8,
        vocab_size=VOCAB,
        decoder_start_token_id=0,
        pad_token_id=0,
    ),
}


def build(name: str, seed: int = 0) -> nn.Module:
    """The family's tiny model, the same on every rank and in the test (eval(): no dropout)."""
    torch.manual_seed(seed)
    return FAMILIES[name]().eval()


def loss_of(name: str, model: nn.Module) -> torch.Tensor:
    """The family's training loss on a fixed batch."""
    g = torch.Generator().manual_seed(1)
    if name == "vit":
        pixels = torch.randn(BATCH, 3, 8, 8, generator=g)
        return model(pixel_values=pixels, labels=torch.tensor([0, 2])).loss
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return model(input_ids=tokens, labels=tokens).loss


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _local_share(module: nn.Module) -> float:
    """What this rank holds of ``module``'s weight: local elements / global elements."""
    w = module.weight
    local = w.to_local() if hasattr(w, "to_local") else w
    return local.numel() / w.numel()


def _original_layout(plan, name: str, grad: torch.Tensor) -> torch.Tensor:
    """A fused layer's gradient in the original order of its outputs (the module holds them per rank)."""
    path, kind = name.rsplit(".", 1)
    if path not in plan.fused:
        return grad.detach().clone()
    dim = plan.out_dims.get(path, 0) if kind == "weight" else 0
    inverse = torch.argsort(fused_permutation(plan.fused[path], plan.tp_size))
    return grad.detach().index_select(dim, inverse)


def split_families(ctx) -> dict:
    """Every family split over tensor_parallel=world size: loss, full gradients, per-rank weight shares."""
    world = dist.get_world_size()
    dims = ParallelDims.for_tensor_parallel(num_nodes=1, devices_per_node=world, tensor_parallel=world)
    mesh = dims.build_mesh("cpu")
    out = {}
    for name in FAMILIES:
        model = build(name)
        plan = infer_tp_plan(model, world)
        apply_tp(model, mesh["tensor_parallel"], plan)
        loss = loss_of(name, model)
        loss.backward()
        named = dict(model.named_modules())
        out[name] = {
            "loss": loss.detach(),
            "grads": {n: _original_layout(plan, n, _full(p.grad)) for n, p in model.named_parameters()},
            "styles": {layer.path: layer.style for layer in plan.layers},
            "shares": {layer.path: _local_share(named[layer.path]) for layer in plan.split},
            "head_attributes": [list(a) for a in plan.head_attributes],
            "state_shapes": {k: tuple(v.shape) for k, v in model.state_dict().items()},
            # fused layers are stored reordered per rank; their state dict must be the original layout
            "fused_state": {
                k: _full(v).detach().clone()
                for k, v in model.state_dict().items()
                if k.rsplit(".", 1)[0] in plan.fused
            },
        }
    return out
