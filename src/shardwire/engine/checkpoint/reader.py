"""Reading a checkpoint: each file verified against the manifest before its first use, and flat buffers
re-sliced for any world size.

A rank at the loading world size holds a part of each parameter that generally spans the parts of
several old ranks (save at 4, load at 3: new rank 1 holds rows 4 to 7 of a 12-row parameter, which
old ranks 1 and 2 held). ``param_run`` assembles any run of a parameter's elements from those parts,
reading only the overlapping slices of the files that hold them, whichever packing saved them
(``Packing.holders``), and ``shard`` a whole new shard from its parameters' runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import pathlib

import torch
from safetensors import safe_open

from shardwire.engine.checkpoint.format import (
    MANIFEST,
    CheckpointError,
    FileRecord,
    FlatRecord,
    Manifest,
    dtype_name,
    outer_key,
    param_key,
    rank_file,
)
from shardwire.engine.packing import Packing, ParamSlot
from shardwire.files import kind_of

_HASH_CHUNK = 1 << 24


class CheckpointReader:
    """A checkpoint opened for reading. Use as a context manager; it closes the files it opened."""

    def __init__(self, directory: str | pathlib.Path):
        self.directory = pathlib.Path(directory)
        self.manifest = Manifest.read(self.directory)
        self._records = {record.name: record for record in self.manifest.files}
        self._files: dict[str, object] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def check_complete(self) -> None:
        """Every file the manifest lists is present with its recorded size (no reading: cheap).

        Each rank verifies the checksums of the files it reads; this catches a missing or truncated
        file that no rank happens to read, since a checkpoint is loaded whole or not at all.
        """
        for record in self.manifest.files:
            self._check_size(record)

    def keys(self, file: str) -> list[str]:
        return self._open(file).keys()

    def tensor(self, file: str, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The tensor ``key`` of ``file``, which must have the ``shape`` and ``dtype`` the manifest
        implies: a wrong one would otherwise fail only when applied, after other state was changed."""
        tensor = self._holding(file, key).get_tensor(key)
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise CheckpointError(
                f"{self.directory / file}: {key!r} is {dtype_name(tensor.dtype)}{list(tensor.shape)} where the "
                f"manifest implies {dtype_name(dtype)}{list(shape)}"
            )
        return tensor

    def param_run(self, flat: FlatRecord, key: str, slot: ParamSlot, start: int, stop: int, dtype: torch.dtype,
                  saving_group: int = 0) -> torch.Tensor:
        """Elements ``[start, stop)`` of ``slot``'s parameter flattened, from the shards of ``flat``
        that the old ranks of group ``saving_group`` saved under ``key`` (``shard_file``), reading
        only the slices that hold them, in ``dtype``. Each slice must be stored in the dtype the
        manifest implies, ``dtype`` itself but for DiLoCo's anchor (fp32, read as the parameters'
        dtype where it stands for them): a manifest edited to say otherwise would cast silently."""
        packing = flat.packing
        stored = torch.float32 if key == outer_key(flat.name, "anchor") else dtype
        out = torch.zeros(stop - start, dtype=dtype)
        for old_rank, held in packing.holders(slot):
            lo, hi = max(start, held.start), min(stop, held.end)
            if lo >= hi:
                continue
            file = self.shard_file(flat, old_rank, saving_group)
            piece = self._holding(file, key).get_slice(key)
            if piece.get_shape() != [packing.shard_numel]:
                raise CheckpointError(
                    f"{self.directory / file}: {key!r} has shape {piece.get_shape()} where the manifest "
                    f"implies [{packing.shard_numel}]"
                )
            at = held.at + lo - held.start
            part = piece[at : at + hi - lo]
            if part.dtype != stored:
                raise CheckpointError(f"{self.directory / file}: {key!r} is {dtype_name(part.dtype)} where the "
                                      f"manifest implies {dtype_name(stored)}")
            out[lo - start : hi - start] = part
        return out

    def shard(self, flat: FlatRecord, key: str, packing: Packing, rank: int, dtype: torch.dtype,
              saving_group: int = 0) -> torch.Tensor:
        """``rank``'s shard of a buffer packed as ``packing`` (for any world size), assembled from what
        ``param_run`` reads of each parameter of ``flat``; zeros in the padding."""
        out = torch.zeros(packing.shard_numel, dtype=dtype)
        for saved, slot in zip(flat.packing.slots, packing.slots):
            held = packing.held(slot, rank)
            if held.numel:
                out[held.at : held.at + held.numel] = self.param_run(flat, key, saved, held.start, held.end, dtype,
                                                                     saving_group)
        return out

    def weights_key(self, flat: FlatRecord) -> str:
        """The key of ``flat``'s weights as every group holds them: under DiLoCo (sync every H steps) each
        group saved its own parameters beside the anchor, the model the groups last agreed on (the
        global model), which is the run's model to all but the group itself (a run with another number
        of groups or without DiLoCo, an export); else the parameters."""
        anchor = outer_key(flat.name, "anchor")
        return anchor if anchor in self.keys(self.shard_file(flat, 0)) else param_key(flat.name)

    @staticmethod
    def shard_file(flat: FlatRecord, old_rank: int, saving_group: int = 0) -> str:
        """The file holding shard ``old_rank`` of ``flat`` as group ``saving_group`` saved it: a
        buffer packed for G ranks is held by ranks g * G onwards (``Manifest.groups``)."""
        return rank_file(saving_group * flat.packing.world_size + old_rank)

    def _holding(self, file: str, key: str):
        """The open (verified) ``file``, which must hold ``key``."""
        handle = self._open(file)
        if key not in handle.keys():
            raise CheckpointError(f"{self.directory / file}: has no tensor {key!r}, which the manifest implies")
        return handle

    def _open(self, name: str):
        if name not in self._files:
            record = self._records.get(name)
            if record is None:
                raise CheckpointError(f"{self.directory / MANIFEST}: lists no file {name!r}")
            self._verify(record)
            path = self.directory / name
            self._files[name] = self._stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
        return self._files[name]

    def _check_size(self, record: FileRecord) -> None:
        path = self.directory / record.name
        if not path.exists():
            raise CheckpointError(
                f"{path}: missing (the manifest lists it with {record.nbytes} bytes); the checkpoint is incomplete"
            )
        if not path.is_file():  # read, a FIFO would wait for a writer, a device never end
            raise CheckpointError(f"{path}: is {kind_of(path)}, where the manifest lists a file of {record.nbytes} "
                                  f"bytes; the checkpoint is damaged")
        size = path.stat().st_size
        if size != record.nbytes:
            what = "truncated" if size < record.nbytes else "longer than written"
            raise CheckpointError(
                f"{path}: {size} bytes where the manifest records {record.nbytes}: the file is {what}"
            )

    def _verify(self, record: FileRecord) -> None:
        self._check_size(record)
        path = self.directory / record.name
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
        if digest.hexdigest() != record.sha256:
            raise CheckpointError(f"{path}: its sha256 differs from the manifest's: the file is corrupted")
