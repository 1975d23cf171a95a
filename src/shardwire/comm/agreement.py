"""What fault-tolerant groups compare when they meet (``shardwire.comm.quorum``): groups with other
settings, a model of other shapes or other starting parameters would average what does not line up,
or never hold one model, each saying it synced with the others. Each is compared as a 32-bit
fingerprint in ``Quorum.agree``'s values, so that a meeting costs no more collectives."""

from __future__ import annotations

import zlib

import torch

from shardwire.comm.communicator import Communicator
from shardwire.options import SettingError


def fingerprint(*parts) -> int:
    """A 32-bit fingerprint of settings and shapes (their ``repr``), for the groups to compare."""
    return zlib.crc32(repr(parts).encode())


def number(value) -> float:
    """A setting's number as the groups compare it: 0.7 given as 7e-1, as an int or as a numpy float
    is one rate, and -0 is 0."""
    return float(value) + 0.0


def shapes_fingerprint(flats: list, ranks: int) -> int:
    """Of the model as a group shards it: each buffer's name, dtype and parameters' shapes, and the
    group's rank count, which sets each rank's shard."""
    return fingerprint(ranks, *((flat.name, str(flat.shard.dtype), [slot.shape for slot in flat.packing.slots])
                                for flat in flats))


def values_fingerprint(tensors: list[torch.Tensor]) -> int:
    """A 32-bit fingerprint of what ``tensors`` (on one device) hold, bit for bit (``word_sums``),
    read on the host once."""
    return fingerprint(*(word_sums(tensors).tolist() if tensors else []))


def word_sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Each tensor's words summed as 64-bit integers, on its device: a sum of its bits that wraps
    alike in any order, so any device and kernel gives the same."""
    return torch.stack([torch.sum(tensor.detach().contiguous().view(_WORDS[tensor.element_size()]),
                                  dtype=torch.int64) for tensor in tensors])


# The integer type of a word of each element size, whose sum fingerprints a tensor's bits.
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def agreement_values(value: int | None) -> list[int]:
    """A 32-bit ``value`` as ``Quorum.agree`` values whose agreed values equal these only where every
    group taking part gave the same: its two 16-bit halves and their complements (``agree`` takes
    the largest of each). None abstains: zeros, which leave the others' agreed values theirs."""
    if value is None:
        return [0] * 4
    halves = [value >> 16, value & 0xFFFF]
    return [*halves, *(0xFFFF - half for half in halves)]


def refuse_another_model(agreed: list[int], shapes: list[int], values: list[int] | None, failed: bool,
                         group: Communicator, averaging: str) -> bool:
    """Refuse, on every rank of this group, a model the other groups cannot average with: ``agreed``
    holds the groups' agreed ``shapes`` and, where this group compared them (``values``; None
    abstained), starting parameters, which differ on a rank holding a part that differs, so the
    ranks say so to each other first, with whether their quorum ``failed`` (then nothing is refused:
    each rank's own values came back). Returns whether the parameters were compared: not where a
    rank's quorum failed."""
    if not failed and agreed[:4] != shapes:
        raise SettingError("the other fault-tolerant groups train a model of other shapes than this one's, or shard "
                           "it over another number of ranks: give every group the same model and as many ranks")
    if values is None:
        return False
    rows = group.all_gather_values([int(failed), int(not failed and agreed[4:8] != values)],
                                   tag="fault tolerance model check")
    if any(failed for failed, _ in rows):
        return False
    if any(differs for _, differs in rows):
        raise SettingError(f"the other fault-tolerant groups start from other parameters than this one's (bit for "
                           f"bit), which {averaging} would never bring together: start every group from the same "
                           f"parameters (the same seed on the same kind of machine, or one checkpoint loaded into "
                           f"every group)")
    return True
