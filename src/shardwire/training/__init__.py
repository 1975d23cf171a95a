"""The training job behind ``shardwire train``: its settings (``config``), its loop (``loop``), and what
the loop uses: the data (``data``), the progress line (``progress``) and the scalar logs (``scalars``)."""
