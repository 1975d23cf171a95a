"""The transport the engine uses: collectives and process groups."""
