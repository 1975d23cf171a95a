"""The reference GPT's sizes under their module's name before the move to ``shardwire.sim.gpt_sizes``
(the simulator reads them, and imports nothing above it): kept for a release, with a warning."""

from __future__ import annotations

from shardwire.renamed import warn_renamed
from shardwire.sim.gpt_sizes import BYTE_VOCAB, PRESETS, GPTConfig

__all__ = ["BYTE_VOCAB", "PRESETS", "GPTConfig"]

warn_renamed("shardwire.models.sizes is renamed shardwire.sim.gpt_sizes")
