"""A GPT in one file: pre-norm decoder blocks, learned positions, an output head tied to the embedding.

It is the model shardwire trains, tests and benchmarks with. Its blocks are the natural sharding
units (``units=[Block]``); the embeddings, final norm and tied head form the root unit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardwire.sim.gpt_sizes import PRESETS, GPTConfig

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
        self.apply(self.init_module)

    def init_module(self, module: nn.Module) -> None:
        """Give one module of this model its initial values, GPT-2's: weights drawn with std 0.02,
        the residual projections' (``attn.proj``, ``mlp.down``) scaled down by the depth so that the
        residual stream's variance stays put, biases zero, norms the identity.

        Each module sets its own parameters and those of its children, so ``self.apply`` of it
        initialises the model (as the constructor does), and a model built on the meta device gets
        the same values a unit at a time from ``shardwire.shard(model, init=model.init_module)``.
        The head is the embedding (tied), set once."""
        residual = 0.02 / (2 * self.config.layers) ** 0.5
        if isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()
        elif isinstance(module, CausalSelfAttention):
            _init_linear(module.qkv, 0.02)
            _init_linear(module.proj, residual)
        elif isinstance(module, MLP):
            _init_linear(module.up, 0.02)
            _init_linear(module.down, residual)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits for each position of ``tokens`` (batch, seq)."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _init_linear(linear: nn.Linear, std: float) -> None:
    nn.init.normal_(linear.weight, mean=0.0, std=std)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32 whatever the compute dtype."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
