"""The engine's fixed bounds that the simulator mirrors: torch-free, so that the simulator imports
them from here without importing torch."""

# Reduce-scatters allowed in flight. Each holds a whole unit's flat gradient until it completes, so
# the bound trades memory for the time a slow reduction gets to finish behind later backward compute.
# Hybrid's all-reduce between groups, which follows, holds only a share and is not bounded.
REDUCTIONS_IN_FLIGHT = 2
