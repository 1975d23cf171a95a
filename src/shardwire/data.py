"""Byte-level text data: a corpus every Python installation has, and batches that depend only on the step.

The default corpus is the ``.py`` files of the standard library: present wherever shardwire runs, so
the main job needs no download. Batches are a pure function of (seed, step): every rank can compute
the global batch and keep its own rows, a run's data position is its step number, and a resumed run
sees exactly the batches an uninterrupted one would have.
"""

from __future__ import annotations

import math
import pathlib
import sysconfig

import torch

VALIDATION_FRACTION = 0.01


class ByteCorpus:
    def __init__(self, data: torch.Tensor, name: str, seq_len: int):
        split = int(data.numel() * (1 - VALIDATION_FRACTION))
        if data.numel() - split <= seq_len + 1:
            needed = math.ceil((seq_len + 2) / VALIDATION_FRACTION)
            raise ValueError(
                f"corpus {name} has only {data.numel():,} bytes: its validation split "
                f"({VALIDATION_FRACTION:.0%}) must hold a sequence of {seq_len + 1} bytes, so give it "
                f"at least {needed:,} bytes of text"
            )
        self.name = name
        self.splits = {"train": data[:split], "val": data[split:]}

    @classmethod
    def load(cls, path: str | None, seq_len: int) -> ByteCorpus:
        """The bytes of ``path`` (a file, or every ``.py``/``.txt``/``.md`` file under a directory),
        or of the standard library's ``.py`` files when ``path`` is None, for sequences of ``seq_len``."""
        if path is None:
            root = pathlib.Path(sysconfig.get_paths()["stdlib"])
            files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
            name = f"the standard library's .py files ({root})"
        else:
            root = pathlib.Path(path)
            if not root.exists():
                raise FileNotFoundError(f"data path {path} does not exist: pass a text file or a directory of them")
            suffixes = {".py", ".txt", ".md"}
            files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.suffix in suffixes)
            name = str(root)
        data = b"".join(p.read_bytes() for p in files)
        if not data:
            what = "is empty" if root.is_file() else "holds no .py, .txt or .md file with any text"
            raise ValueError(f"data path {path} {what}: give it a text file or a directory of them")
        return cls(torch.frombuffer(bytearray(data), dtype=torch.uint8), name, seq_len)

    @property
    def num_bytes(self) -> int:
        return sum(split.numel() for split in self.splits.values())

    def batch(self, step: int, global_batch: int, seq_len: int, *, seed: int = 0, split: str = "train") -> torch.Tensor:
        """Rows of ``seq_len + 1`` tokens (inputs and shifted targets) for the whole global batch."""
        data = self.splits[split]
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 2 + (split == "val"))
        starts = torch.randint(0, data.numel() - seq_len - 1, (global_batch,), generator=gen)
        return torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).long()
