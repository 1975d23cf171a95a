"""Where a step's time went: spans, interval arithmetic, FLOPs and MFU."""
