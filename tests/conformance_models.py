"""The conformance table: standard model families written elsewhere, as tiny, seed-deterministic configs.

Every model is built in code (no downloads), trains in fp32 and has no dropout, so that N ranks and one
plain process compute the same losses. Each row also says, independently of the library, which of its
parameters are the blocks FSDP must shard (``block``: a regex whose match is the block's name) and which
are the attention and MLP projections tensor parallelism must split (``tp``). Used by
tests/scenarios/conformance.py (the runs), tests/test_conformance.py (the reference and the checks) and
docs/hooks/supported_models.py (the "Supported models" page).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

VOCAB, SEQ, WIDTH, HEADS, FFN, LAYERS = 64, 8, 32, 4, 64, 2
N_SAMPLES, FEATURES, CLASSES, IMAGE = 24, 16, 4, 8


@dataclass(frozen=True)
class ConformanceModel:
    """One row of the table.

    Attributes:
        name: the row's key.
        family: what a reader knows the model as.
        build: ``build() -> nn.Module`` (call under a fixed seed).
        data: ``"tokens"``, ``"seq2seq"``, ``"images"`` or ``"features"``.
        block: regex; the part of a parameter name it matches is the name of the block holding it.
        tp: regex; parameter names (relative to the model) that must be split 1/tp under tp_dp (the weights
            of the attention and MLP projections; matrices only); ``""`` when the model has none.
        sync_batchnorm: run with ``lp.SyncBatchNormConversion()``.
    """

    name: str
    family: str
    build: Callable[[], nn.Module]
    data: str
    block: str
    tp: str
    sync_batchnorm: bool = False


# --- Hugging Face families --------------------------------------------------------------------------------


def gpt2(
    layers: int = LAYERS, width: int = WIDTH, vocab: int = VOCAB, positions: int = SEQ, ffn: int = FFN
) -> nn.Module:
    """The table's tiny GPT-2; the arguments make larger ones of the same family (`advise --model-kwargs`)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab,
        n_positions=positions,
        n_embd=width,
        n_layer=layers,
        n_head=HEADS,
        n_inner=ffn,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=FFN,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForMaskedLM(config)


def t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB,
        d_model=WIDTH,
        d_kv=WIDTH // HEADS,
        d_ff=FFN,
        num_layers=LAYERS,
        num_decoder_layers=LAYERS,
        num_heads=HEADS,
        relative_attention_num_buckets=8,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return T5ForConditionalGeneration(config)


def vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=IMAGE,
        patch_size=4,
        num_channels=3,
        hidden_size=WIDTH,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=FFN,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=CLASSES,
    )
    return ViTForImageClassification(config)


def _decoder_config(config_cls):
    return config_cls(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS // 2,
        max_position_embeddings=SEQ,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(_decoder_config(LlamaConfig))


def qwen2() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(_decoder_config(Qwen2Config))  # q/k/v with biases, grouped KV heads


# --- torch's built-in transformer layers ------------------------------------------------------------------


class TorchEncoderLM(nn.Module):
    """Embedding -> ``nn.TransformerEncoder`` (``nn.MultiheadAttention``, batch_first) -> vocabulary head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, FFN, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


class TorchDecoderLM(nn.Module):
    """``nn.TransformerDecoder`` with a causal mask, cross-attending to the embedded source tokens."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerDecoderLayer(WIDTH, HEADS, FFN, dropout=0.0, batch_first=True)
        self.decoder = nn.TransformerDecoder(layer, LAYERS)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        return self.head(self.decoder(self.embed(tgt), self.embed(src), tgt_mask=mask, tgt_is_causal=True))


# --- plain PyTorch models ----------------------------------------------------------------------------------


def _conv_stage(channels_in: int, channels_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(channels_in, channels_out, 3, padding=1), nn.BatchNorm2d(channels_out), nn.ReLU()
    )


class ConvNet(nn.Module):
    """A stem and repeated ``nn.Sequential`` conv stages with BatchNorm, pooled into a linear classifier."""

    def __init__(self):
        super().__init__()
        self.stem = _conv_stage(3, 8)
        self.stages = nn.Sequential(_conv_stage(8, 8), _conv_stage(8, 8))
        self.head = nn.Linear(8, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(images)).mean((2, 3)))


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(FEATURES, WIDTH),
        nn.Tanh(),
        nn.Linear(WIDTH, WIDTH),
        nn.Tanh(),
        nn.Linear(WIDTH, WIDTH),
        nn.Tanh(),
        nn.Linear(WIDTH, CLASSES),
    )


class ResidualSequentialNet(nn.Module):
    """Residual blocks written as a ``nn.ModuleList`` of ``nn.Sequential`` (no block class of their own)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(FEATURES, WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, FFN), nn.GELU(), nn.Linear(FFN, WIDTH))
            for _ in range(3)
        )
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


MODELS: dict[str, ConformanceModel] = {
    m.name: m
    for m in [
        ConformanceModel(
            "gpt2",
            "HF GPT-2 (`GPT2LMHeadModel`: `Conv1D`, packed `c_attn`)",
            gpt2,
            "tokens",
            r"^transformer\.h\.\d+\.",
            r"^transformer\.h\.\d+\.(attn|mlp)\.\w+\.weight$",
        ),
        ConformanceModel(
            "bert",
            "HF BERT (`BertForMaskedLM`)",
            bert,
            "tokens",
            r"^bert\.encoder\.layer\.\d+\.",
            r"^bert\.encoder\.layer\.\d+\..*(query|key|value|dense)\.weight$",
        ),
        ConformanceModel(
            "t5",
            "HF T5 (`T5ForConditionalGeneration`: relative position bias, cross-attention)",
            t5,
            "seq2seq",
            r"^(encoder|decoder)\.block\.\d+\.",
            r"^(encoder|decoder)\.block\.\d+\.layer\.\d+\.\w+\.(q|k|v|o|wi|wo)\.weight$",
        ),
        ConformanceModel(
            "vit",
            "HF ViT (`ViTForImageClassification`)",
            vit,
            "images",
            r"^vit\.layers\.\d+\.",
            r"^vit\.layers\.\d+\.(attention|mlp)\.\w+\.weight$",
        ),
        ConformanceModel(
            "llama",
            "HF Llama (`LlamaForCausalLM`, grouped KV heads)",
            llama,
            "tokens",
            r"^model\.layers\.\d+\.",
            r"^model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$",
        ),
        ConformanceModel(
            "qwen2",
            "HF Qwen2 (`Qwen2ForCausalLM`, grouped KV heads, q/k/v biases)",
            qwen2,
            "tokens",
            r"^model\.layers\.\d+\.",
            r"^model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$",
        ),
        # torch's attention may be converted to an equivalent module first: its names may change, so
        # every matrix inside a layer counts (norms are vectors)
        ConformanceModel(
            "torch_encoder",
            "`nn.TransformerEncoder` (`nn.MultiheadAttention`, batch_first)",
            TorchEncoderLM,
            "tokens",
            r"^encoder\.layers\.\d+\.",
            r"^encoder\.layers\.\d+\.",
        ),
        ConformanceModel(
            "torch_decoder",
            "`nn.TransformerDecoder` (self- and cross-attention)",
            TorchDecoderLM,
            "seq2seq",
            r"^decoder\.layers\.\d+\.",
            r"^decoder\.layers\.\d+\.",
        ),
        ConformanceModel(
            "cnn",
            "CNN: `nn.Sequential` conv stages with BatchNorm (`SyncBatchNormConversion`)",
            ConvNet,
            "images",
            r"^(stem|stages\.\d+)\.",
            "",
            sync_batchnorm=True,
        ),
        ConformanceModel(
            "mlp",
            "plain MLP (`nn.Sequential` of `Linear`/`Tanh`)",
            mlp,
            "features",
            r"^\d+\.",
            r"^\d+\.weight$",
        ),
        ConformanceModel(
            "sequential_blocks",
            "residual blocks as a `nn.ModuleList` of `nn.Sequential`",
            ResidualSequentialNet,
            "features",
            r"^blocks\.\d+\.",
            r"^blocks\.\d+\.\d+\.weight$",
        ),
    ]
}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name].build()


def dataset(name: str, n: int = N_SAMPLES, seed: int = 0) -> TensorDataset:
    """The synthetic data of the model's kind; the last column is the sample index."""
    g = torch.Generator().manual_seed(seed)
    kind = MODELS[name].data
    if kind == "tokens":
        tokens = torch.randint(1, VOCAB, (n, SEQ + 1), generator=g)
        cols = [tokens[:, :-1], tokens[:, 1:]]
    elif kind == "seq2seq":
        cols = [
            torch.randint(1, VOCAB, (n, SEQ), generator=g),
            torch.randint(1, VOCAB, (n, SEQ + 1), generator=g),
        ]
    elif kind == "images":
        cols = [torch.randn(n, 3, IMAGE, IMAGE, generator=g), torch.randint(0, CLASSES, (n,), generator=g)]
    else:
        cols = [torch.randn(n, FEATURES, generator=g), torch.randint(0, CLASSES, (n,), generator=g)]
    return TensorDataset(*cols, torch.arange(n))


def _logits(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.logits


def loss_fn(name: str) -> Callable[[nn.Module, tuple], torch.Tensor]:
    """``loss(model, batch)``: the mean cross-entropy of ``batch`` (every token or sample counts once)."""
    kind = MODELS[name].data

    def loss(model: nn.Module, batch) -> torch.Tensor:
        if kind == "seq2seq":
            src, tgt = batch[0], batch[1]
            if name == "t5":
                out = _logits(model(input_ids=src, decoder_input_ids=tgt[:, :-1]))
            else:
                out = _logits(model(src, tgt[:, :-1]))
            return F.cross_entropy(out.flatten(0, 1).float(), tgt[:, 1:].flatten())
        out = _logits(model(batch[0]))
        if kind == "tokens":
            return F.cross_entropy(out.flatten(0, 1).float(), batch[1].flatten())
        return F.cross_entropy(out.float(), batch[1])

    return loss
