"""The transport the engine uses: collectives, process groups and node topology."""
