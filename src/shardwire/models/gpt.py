"""A GPT in one file: pre-norm decoder blocks, learned positions, an output head tied to the embedding.

It is the model shardwire trains, tests and benchmarks with. Its blocks are the natural sharding
units (``units=[Block]``); the embeddings, final norm and tied head form the root unit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardwire.models.sizes import PRESETS, GPTConfig

__all__ = ["GPT", "GPTConfig", "PRESETS", "Block", "loss_fn"]


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
