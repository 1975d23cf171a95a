"""A GPT in one file: pre-norm decoder blocks, learned positions, an output head tied to the embedding.

It is the model shardwire trains, tests and benchmarks with. Its blocks are the natural sharding
units (``units=[Block]``); the embeddings, final norm and tied head form the root unit.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from shardwire.sim.specs import ModelSpec


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # bytes
    seq_len: int = 128
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    dropout: float = 0.0

    def spec(self, name: str = "gpt") -> ModelSpec:
        """This GPT as the simulator and the FLOP count describe a model."""
        return ModelSpec(name=name, layers=self.layers, hidden=self.hidden, heads=self.heads, vocab=self.vocab_size,
                         seq_len=self.seq_len, learned_positions=True, tied_embeddings=True)

    def num_params(self) -> int:
        """Parameters, counting the tied embedding once."""
        h = self.hidden
        block = 12 * h * h + 10 * h  # qkv + proj + 4h MLP, their biases, two LayerNorms
        return self.vocab_size * h + self.seq_len * h + self.layers * block + 2 * h


# Sizes by name. "tiny" is for tests; "small" trains visibly in two minutes on two CPU cores;
# "30m" is the size the CPU benchmarks compare systems on. The "gpt-" sizes are the GPU benchmarks':
# the shapes of GPT-3's Small, Medium and XL (Brown et al. 2020, table 2.1; XL with 16 heads of 128) at
# 2048 positions, with GPT-2's vocabulary padded to a multiple of 64 (50304) as nanoGPT pads it.
PRESETS = {
    "tiny": GPTConfig(seq_len=32, layers=3, hidden=32, heads=2),
    "small": GPTConfig(seq_len=128, layers=4, hidden=128, heads=4),
    "medium": GPTConfig(seq_len=256, layers=6, hidden=384, heads=6),
    "30m": GPTConfig(seq_len=256, layers=8, hidden=576, heads=8),
    "gpt-125m": GPTConfig(vocab_size=50304, seq_len=2048, layers=12, hidden=768, heads=12),
    "gpt-350m": GPTConfig(vocab_size=50304, seq_len=2048, layers=24, hidden=1024, heads=16),
    "gpt-1.3b": GPTConfig(vocab_size=50304, seq_len=2048, layers=24, hidden=2048, heads=16),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.heads = config.heads
        # No bias: a key bias only shifts every attention logit of a query equally, which softmax
        # ignores, so its gradient is rounding noise that Adam would amplify into random updates.
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden, bias=False)
        self.proj = nn.Linear(config.hidden, config.hidden)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(x).split(hidden, dim=2)
        q, k, v = (t.view(batch, seq, self.heads, hidden // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(batch, seq, hidden))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.up = nn.Linear(config.hidden, 4 * config.hidden)
        self.down = nn.Linear(4 * config.hidden, config.hidden)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden)
        self.attn = CausalSelfAttention(config)
        self.norm2 = nn.LayerNorm(config.hidden)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.hidden)
        self.pos_emb = nn.Embedding(config.seq_len, config.hidden)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.hidden)
        self.head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.down.weight")):
                # GPT-2: scale residual projections by depth so the residual stream's variance stays put.
                nn.init.normal_(param, mean=0.0, std=0.02 / (2 * config.layers) ** 0.5)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits for each position of ``tokens`` (batch, seq)."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32 whatever the compute dtype."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
