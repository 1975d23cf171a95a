"""The sizes of the project's GPT, without torch: what ``shardwire train --model`` names and what the
simulator and the planner describe, from one table (``GPTConfig.spec()``).
"""

from __future__ import annotations

import dataclasses

from shardwire.sim.specs import ModelSpec

# The ids of text read as bytes: the GPT's vocabulary, and the default corpus's.
BYTE_VOCAB = 256


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = BYTE_VOCAB
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
