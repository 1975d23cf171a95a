"""What the simulator is asked about: a model, a cluster and a training configuration.

Each spec is a frozen dataclass built from a plain mapping (a preset, JSON or YAML) by ``parse``,
which names missing and unknown keys and rejects impossible values, so that a typo or a wrong unit
becomes an error instead of a confident, wrong prediction. A model's optional sizes whose default
depends on others (``ffn_hidden`` = 4 x ``hidden``, ``kv_heads`` = ``heads``, ...) are resolved at
construction, so the spec reads, and serializes, as what is simulated.

Units: sizes in bytes, except ``gpu_memory_gb`` (GiB, as GPU memory is sold and reported);
bandwidths in GB/s (1e9 bytes/s, as nccl-tests reports them); latencies in microseconds.

Every number has a range (``LIMITS``): finite, positive (or at least 0), and at most a bound far
beyond anything built or published, so that only a wrong unit or a typo meets it. The bounds keep
every simulated time and byte count finite and the simulation's work bounded (one object per layer,
events in proportion to units x micro-batches).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Any

from shardwire.comm.wire import Wire
from shardwire.engine.diloco import DiLoCo, uses_renamed_keys
from shardwire.engine.layout_plan import LAYOUTS as ENGINE_LAYOUTS
from shardwire.gpus import SMS
from shardwire.mappings import nearest, shown
from shardwire.renamed import warn_renamed


class SpecError(ValueError):
    """A model, cluster or training description that cannot be simulated; the message says why."""


MODEL_KINDS = ("decoder", "encoder-decoder")
ATTENTION_KINDS = ("flash", "eager")
NORMS = ("layernorm", "rmsnorm")
# The engine's layouts, FSDP's SHARD_GRAD_OP (full, kept gathered from forward to backward) and
# ZeRO-1 (parameters whole on every GPU, optimizer state sharded), which the simulator prices so
# that runs of other tools can be described as they ran.
LAYOUTS = (*ENGINE_LAYOUTS, "grad_op", "zero1")
LIMITERS = ("sliding", "block")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
REDUCE_PRECISIONS = ("fp32", "bf16", "fp16")
ALGORITHMS = ("ring", "hierarchical")
BYTES_PER_ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


@dataclasses.dataclass(frozen=True)
class Limit:
    """The range of one number: finite and positive (at least 0 when ``zero``), at least ``low`` and
    at most ``high``; ``below`` and ``above`` complete the message "<key> <value> is ..." for a value
    outside them, saying what is wrong and what to do."""

    high: float
    above: str
    low: float = 0.0
    below: str = ""
    zero: bool = False


# Model sizes. Layers: ten times the deepest published models (GPT-3: 96 blocks; Llama 3 405B: 126);
# the simulator builds one unit per layer and steps through every one.
MAX_LAYERS = 1024
# Widths (hidden, MLP, heads): over ten times the widest published (PaLM 540B: hidden 18,432, MLP 73,728).
MAX_WIDTH = 2**20
# Vocabulary: over sixty times the largest published (Gemma: 256k tokens).
MAX_VOCAB = 2**24
# Sequence: 16M tokens, beyond the longest contexts published (Gemini 1.5 was evaluated on 10M).
MAX_SEQ_LEN = 2**24
# A stated parameter count: over 500 times the largest published models (Switch-C: 1.6T).
MAX_PARAMS = 10**15
# Nodes: 524,288 GPUs at 8 per node, beyond the largest GPU clusters built (a few hundred thousand).
MAX_NODES = 2**16
# GPUs per node: beyond the largest NVLink domains (GB200 NVL72: 72 GPUs).
MAX_GPUS_PER_NODE = 1024
# Sequences per GPU and micro-batch, and per step for the planner: a million, hundreds of times the
# largest published batches (a few thousand sequences).
MAX_BATCH = 2**20
# Each micro-batch of a step is simulated in full, so their number bounds the simulation's cost.
MAX_GRAD_ACCUM = 256

_WIDTH = Limit(MAX_WIDTH, f"over {MAX_WIDTH:,}, ten times the widest published layers: give the width in elements")
_HEADS = Limit(MAX_WIDTH, f"over {MAX_WIDTH:,}, more than hidden can be: heads must divide hidden")
_SEQUENCE = Limit(MAX_SEQ_LEN, f"over {MAX_SEQ_LEN:,} tokens, beyond any published context: give tokens per sequence")
_LAYERS = Limit(MAX_LAYERS, f"more blocks than the simulator builds (at most {MAX_LAYERS:,} per stack, ten times "
                            f"the deepest published models)")
# Bandwidths: from 10 kB/s, under the testbed's slowest link (100 kbit/s), to 1e12 GB/s.
# Rates have upper bounds far above physics (HBM3e moves 8 TB/s, a GPU does petaFLOP/s) so that an
# experiment can make communication or compute free, as tests do; only their lower bounds can make
# times long, and those keep every time finite.
# From 1 MFLOP/s, far below one CPU core (the calibration's "GPU"), to 1e9 TFLOP/s.
MIN_PEAK_TFLOPS, MAX_PEAK_TFLOPS = 1e-6, 10**9
_PEAK = Limit(
    low=MIN_PEAK_TFLOPS, below="under 1e-06 TFLOP/s (1 MFLOP/s), slower than any processor: peaks are in TFLOP/s",
    high=MAX_PEAK_TFLOPS,
    above="over 1e9 TFLOP/s, a hundred thousand times any GPU: peaks are in TFLOP/s (1e12 FLOP/s)",
)
# The least fraction of its peak a GPU's kernels are taken to reach.
MIN_EFFICIENCY = 1e-4
_EFFICIENCY = Limit(
    low=MIN_EFFICIENCY, below="under 0.0001 of peak, the fraction in (0, 1] its kernels reach: lower the peak instead",
    high=1.0, above="over 1: it is the fraction of the peak its kernels reach, in (0, 1]",
)
MIN_BANDWIDTH_GBPS = 1e-5
_BANDWIDTH = Limit(
    low=MIN_BANDWIDTH_GBPS, below="under 1e-05 GB/s (10 kB/s), slower than any network: bandwidths are in GB/s (1e9 bytes/s)",
    high=1e12, above="over 1e12 GB/s, a hundred million times any memory or link: bandwidths are in GB/s "
                     "(1e9 bytes/s)",
)

LIMITS = types.MappingProxyType({
    "layers": _LAYERS,
    "decoder_layers": _LAYERS,
    "hidden": _WIDTH,
    "ffn_hidden": _WIDTH,
    "heads": _HEADS,
    "kv_heads": _HEADS,
    "head_dim": _WIDTH,
    "vocab": Limit(MAX_VOCAB, f"over {MAX_VOCAB:,} tokens, sixty times the largest published vocabularies"),
    "seq_len": _SEQUENCE,
    "decoder_seq_len": _SEQUENCE,
    "positions": _SEQUENCE,
    "params": Limit(MAX_PARAMS, f"over {MAX_PARAMS:.0e} parameters, 500 times the largest published models: "
                                f"give the count itself, not in millions or billions"),
    "nodes": Limit(MAX_NODES, f"more nodes than the simulator takes (at most {MAX_NODES:,}, beyond the largest "
                              f"GPU clusters)"),
    "gpus_per_node": Limit(MAX_GPUS_PER_NODE, f"more GPUs per node than the simulator takes (at most "
                                              f"{MAX_GPUS_PER_NODE:,}, beyond the largest NVLink domains)"),
    "peak_tflops": _PEAK,
    "fp8_tflops": _PEAK,
    "fp32_tflops": _PEAK,
    # 64 TiB: two hundred times the largest GPU memories (288 GB).
    "gpu_memory_gb": Limit(2**16, "over 65,536 GiB, two hundred times any GPU's memory: give it in GiB"),
    "busbw_GBps": _BANDWIDTH,
    "memory_bandwidth_GBps": _BANDWIDTH,
    "optimizer_GBps": _BANDWIDTH,
    # One second per step of a collective: several times an intercontinental round trip.
    "latency_us": Limit(1e6, "over 1,000,000 us (1 s) per step, several times an intercontinental round trip: "
                             "latencies are in microseconds", zero=True),
    "micro_batch": Limit(MAX_BATCH, f"over {MAX_BATCH:,} sequences, hundreds of times the largest published "
                                    f"batches: micro_batch is sequences per GPU"),
    "shard_group_size": Limit(MAX_NODES * MAX_GPUS_PER_NODE, "more GPUs than the simulator's largest cluster: "
                                                           "shard_group_size counts GPUs"),
    "grad_accum": Limit(MAX_GRAD_ACCUM, f"more micro-batches than the simulator steps through (at most "
                                        f"{MAX_GRAD_ACCUM}, each simulated event by event): raise micro_batch"),
    # A GPT block holds six modules with parameters; a thousand is beyond any unit's.
    "gathers_per_unit": Limit(1024, "over 1,024 all-gathers for one unit, more than any unit has modules: "
                                    "gathers_per_unit counts the collectives that fetch a unit's parameters"),
    "reduce_bucket_elements": Limit(MAX_PARAMS, f"over {MAX_PARAMS:.0e} elements, more than any model's "
                                                f"gradient: reduce_bucket_elements counts the elements of a bucket"),
    # No model has more units than this, and the engine gathers ahead no further than its last unit.
    "prefetch": Limit(2 * MAX_LAYERS, f"more units than any model has (at most {2 * MAX_LAYERS:,}): prefetch "
                                      f"counts units gathered ahead", zero=True),
    # From 100k elements/s, far below one CPU core (the testbed encodes about 0.4 billion a second), to
    # a million times what any GPU's memory allows (H100: about 335 billion).
    "quantize_gelems": Limit(
        low=1e-4, below="under 0.0001 (100k elements/s), slower than any processor: quantize_gelems is in "
                        "billions of elements per second",
        high=1e9, above="over 1e9, a million times what any GPU's memory allows: quantize_gelems is in billions "
                        "of elements per second",
    ),
    # A collective taking all of the compute would stop it; over 99% the share is in percent, not a fraction.
    "compute_share": Limit(0.99, "over 0.99: it is the fraction of compute a running collective takes, in [0, 1)",
                           zero=True),
    "all_gather_share": Limit(0.99, "over 0.99: it is the fraction of compute a running all-gather takes, in [0, 1)",
                              zero=True),
    "bandwidth_share": Limit(0.99, "over 0.99: it is the fraction of a level's bandwidth running compute takes, "
                                   "in [0, 1)", zero=True),
    # A selective checkpointing policy recomputes some of a block's forward: a fraction in (0, 1].
    "recompute_fraction": Limit(
        low=1e-3, below="under 0.001 of a block's forward: turn activation_checkpointing off instead",
        high=1.0, above="over 1: it is the fraction of a block's forward FLOPs backward recomputes, in (0, 1]",
    ),
    # Kernels at under 0.01% of peak: the peak is wrong, not the kernels.
    "matmul_efficiency": _EFFICIENCY,
    "attention_efficiency": _EFFICIENCY,
    "memory_efficiency": _EFFICIENCY,
})


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A transformer, described by the sizes that determine its FLOPs, bytes and activations.

    ``layers`` counts the blocks of a decoder-only model, or of each stack of an encoder-decoder
    (``decoder_layers`` when the decoder differs); ``seq_len`` is the (encoder) input length and
    ``decoder_seq_len`` the target length of an encoder-decoder. ``ffn_gated`` marks a gated MLP
    (three matrices: SwiGLU, gated GELU); ``kv_heads`` < ``heads`` is grouped-query attention;
    ``head_dim`` is each head's width, ``hidden / heads`` unless the model says otherwise (Qwen3's
    and Gemma's heads are wider, so their attention is wider than the model); ``positions`` is the
    rows of a decoder's learned position table where it has more than ``seq_len`` (GPT-2's
    ``n_positions``, whatever length it trains at);
    ``attention`` is ``flash`` (scores never stored, as with SDPA/FlashAttention) or ``eager``
    (the score matrix is materialized and kept for backward). ``norm`` is ``layernorm`` (one fused
    kernel even in eager PyTorch) or ``rmsnorm`` (Llama's and T5's, which eager PyTorch runs as a
    chain of fp32 kernels). ``params``, when given, is the published parameter count, checked
    against the count the architecture implies.
    """

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    name: str = "custom"
    kind: str = "decoder"
    ffn_hidden: int | None = None
    ffn_gated: bool = False
    kv_heads: int | None = None
    head_dim: int | None = None
    decoder_layers: int | None = None
    decoder_seq_len: int | None = None
    tied_embeddings: bool = True
    learned_positions: bool = False
    positions: int | None = None
    attention: str = "flash"
    norm: str = "layernorm"
    params: int | None = None

    def __post_init__(self):
        _check_limits(self, "layers", "hidden", "heads", "vocab", "seq_len")
        _choice(self, "kind", MODEL_KINDS)
        _choice(self, "attention", ATTENTION_KINDS)
        _choice(self, "norm", NORMS)
        _resolve(self, ffn_hidden=_given(self.ffn_hidden, 4 * self.hidden), kv_heads=_given(self.kv_heads, self.heads))
        _check_limits(self, "ffn_hidden", "kv_heads")
        if self.head_dim is None and self.hidden % self.heads:
            raise SpecError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads}), or give each "
                            f"head's width (head_dim)")
        if self.head_dim is not None:
            _check_limits(self, "head_dim")
        if self.positions is not None:
            _check_limits(self, "positions")
            if not self.learned_positions or self.kind != "decoder" or self.positions < self.seq_len:
                raise SpecError(f"positions ({self.positions}) are the rows of a decoder's learned position table, "
                                f"at least its seq_len ({self.seq_len}): give learned_positions: true, or leave it out")
        if self.heads % self.kv_heads:
            raise SpecError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.kind == "decoder":
            for key in ("decoder_layers", "decoder_seq_len"):
                if getattr(self, key) is not None:
                    raise SpecError(f"{key} applies to kind 'encoder-decoder' only")
        else:
            _resolve(self, decoder_layers=_given(self.decoder_layers, self.layers),
                     decoder_seq_len=_given(self.decoder_seq_len, self.seq_len))
            _check_limits(self, "decoder_layers", "decoder_seq_len")
        if self.params is not None:
            _check_limits(self, "params")

    @property
    def head_width(self) -> int:
        """Each head's width: ``head_dim``, or where the model gives none, ``hidden / heads``. Not
        resolved into ``head_dim``, so that a preset whose ``hidden`` or ``heads`` is changed gets
        the width they give."""
        return _given(self.head_dim, self.hidden // self.heads)


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """One level of the network as collectives see it.

    ``busbw_GBps`` follows nccl-tests: for the intra-node level, what one GPU's links deliver; for
    the inter-node level, what one node's NICs deliver together (the busbw of a collective with one
    rank per node). ``latency_us`` is the fixed cost of one step of a collective's algorithm on this
    level (a ring over k members takes k - 1 steps). ``compute_share`` is the fraction of a GPU's
    compute a collective on this level takes while it runs (the SMs its kernels hold and the memory
    bandwidth they use; on CPUs, the cores its threads take): compute runs at ``1 - compute_share``
    of its rate meanwhile (``shardwire.sim.costs``); ``all_gather_share``, where given, is what its
    all-gathers take instead, where their library's kernels differ from its other collectives'
    (SMDDP's all-gather beside NCCL's reduce-scatter: ``COLLECTIVES``).
    ``bandwidth_share`` is the converse, the
    fraction of this level's bandwidth that running compute takes from its collectives (on CPUs, the
    cores gloo's threads need to move and sum bytes; on GPUs, where a collective's SMs are its own,
    0 unless measured): while compute runs, they move bytes at ``1 - bandwidth_share`` of the rate.
    """

    busbw_GBps: float
    latency_us: float = 0.0
    compute_share: float = 0.0
    bandwidth_share: float = 0.0
    all_gather_share: float | None = None

    def __post_init__(self):
        _check_limits(self, "busbw_GBps", "latency_us", "compute_share", "bandwidth_share")
        if self.all_gather_share is not None:
            _check_limits(self, "all_gather_share")


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """Nodes of identical GPUs: their compute, memory and the two levels of network between them.

    The GPU is what the compute model (``shardwire.sim.compute``) prices kernels with: its dense
    tensor-core peaks per dtype (``peak_tflops`` for bf16 and fp16, ``fp8_tflops`` where it has fp8
    tensor cores, ``fp32_tflops`` for fp32 matrix multiplies, by default ``peak_tflops``: one rate
    for every dtype, as a CPU; ``bf16`` false for a GPU whose tensor cores take fp16 only, as the
    V100's, where ``precision: bf16`` is refused), its memory and ``memory_bandwidth_GBps``, and the
    fractions of those peaks its kernels reach: ``matmul_efficiency`` for large matrix multiplies,
    ``attention_efficiency`` for a fused attention kernel, ``memory_efficiency`` for memory-bound
    kernels. ``gpu`` names the preset these figures came from (``shardwire.sim.presets.GPUS``).
    Without a memory bandwidth, memory-bound work (norms, activations, casts, the optimizer step) is
    left out of the prediction (and the report says so). ``optimizer_GBps`` is the rate the
    optimizer step streams its bytes at where it was measured (``shardwire.sim.calibrate``): a step
    is more than its bytes (per-tensor launches, the casts of the updated shards), so it can be
    slower than other memory-bound work.

    ``algorithm`` is how all-gathers and reduce-scatters cross the levels (see
    ``shardwire.sim.costs``). ``quantize_gelems`` prices the kernels of a quantized wire
    (``TrainingSpec.wire``): billions of elements one GPU encodes or decodes per second; without it
    they are left out (and the report says so). ``collectives`` names the collective library the
    cluster runs: ``nccl`` (every preset's figures are NCCL's) or ``smddp`` (SageMaker's, on AWS
    p4d and p4de only, whose all-gathers across nodes are faster and hold fewer SMs). The library is
    resolved as the spec is made, however it is made, so that the spec reads as what is simulated:
    ``CollectiveLibrary.inter_node`` refuses it where it does not run and
    sets the inter-node level it runs.
    """

    nodes: int
    gpus_per_node: int
    peak_tflops: float
    gpu_memory_gb: float
    intra_node: LinkSpec
    inter_node: LinkSpec
    name: str = "custom"
    gpu: str = "custom"
    fp8_tflops: float | None = None
    fp32_tflops: float | None = None
    bf16: bool = True
    matmul_efficiency: float = 0.7
    attention_efficiency: float = 0.5
    memory_efficiency: float = 0.8
    algorithm: str = "ring"
    memory_bandwidth_GBps: float | None = None
    optimizer_GBps: float | None = None
    quantize_gelems: float | None = None
    collectives: str = "nccl"

    def __post_init__(self):
        _check_limits(self, "nodes", "gpus_per_node", "peak_tflops", "gpu_memory_gb", "matmul_efficiency",
                      "attention_efficiency", "memory_efficiency")
        _choice(self, "algorithm", ALGORITHMS)
        for key in ("fp8_tflops", "fp32_tflops", "memory_bandwidth_GBps", "optimizer_GBps", "quantize_gelems"):
            if getattr(self, key) is not None:
                _check_limits(self, key)
        _choice(self, "collectives", tuple(COLLECTIVES))
        _resolve(self, inter_node=COLLECTIVES[self.collectives].inter_node(self))

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    def matmul_tflops(self, precision: str) -> float:
        """The dense peak a matrix multiply in ``precision`` runs at; raises ``SpecError`` for fp8 on
        a GPU without fp8 tensor cores, and for bf16 on one without bf16 (the V100)."""
        if precision == "fp8":
            if self.fp8_tflops is None:
                raise SpecError(f"precision fp8 needs fp8 tensor cores: cluster {self.name!r} gives no fp8_tflops "
                                f"(H100 and later have them; A100 does not)")
            return self.fp8_tflops
        if precision == "bf16" and not self.bf16:
            raise SpecError(f"precision bf16 needs bf16 tensor cores: cluster {self.name!r} ({self.gpu}) has none "
                            f"(V100 and older multiply 16-bit values in fp16 only); give precision fp16")
        if precision == "fp32":
            return self.peak_tflops if self.fp32_tflops is None else self.fp32_tflops
        return self.peak_tflops


@dataclasses.dataclass(frozen=True)
class TrainingSpec:
    """How the step runs: batch, layout, the gather schedule, precision and recomputation.

    ``micro_batch`` is sequences per GPU and micro-batch; ``grad_accum`` micro-batches make a step,
    all but the last without reduction, accumulating unsharded gradients (as ``no_sync`` does), or,
    with ``reduce_each_micro_batch``, each reduce-scattered as it ends (what FSDP does unless told
    ``no_sync``, as Composer and FSDP2 run accumulation by default).
    ``layout``: ``full`` shards parameters, gradients and optimizer state over every GPU;
    ``grad_op`` (FSDP's SHARD_GRAD_OP) keeps each unit gathered from its forward to the end of its
    backward; ``hybrid`` shards within groups of ``shard_group_size`` GPUs and replicates across
    them, all-reducing gradient shards between groups; ``hybrid_secondary`` (ZeRO++'s hpZ) shards
    as ``full`` and gathers for backward within the group, from a secondary shard kept since forward
    (``shardwire.engine.layout_plan``); ``zero1`` (ZeRO stage 1, as DeepSpeed and InternLM run it;
    DDP with ``shard_group_size`` 1) keeps the whole model and its gradient on every GPU, splits the
    fp32 masters and optimizer state within groups of ``shard_group_size``, all-reduces each
    gradient over every GPU in one flat collective as backward produces it, a bucket of
    ``reduce_bucket_elements`` at a time (default: a unit at a time), and
    all-gathers the updated parameters within the group after the optimizer step; the engine does
    not run it. ``shard_group_size`` defaults to a node's GPUs; a group is a
    divisor of a node or a whole number of nodes. ``prefetch`` units are gathered ahead of the
    running one, by a ``sliding`` window (the engine's) or a ``block``-and-flush limiter that issues
    them in groups and waits for a group to be consumed before issuing the next.
    ``gathers_per_unit`` is the all-gathers that fetch a unit's parameters, each paying its
    collective's latency: 1 where a unit's parameters are one flat buffer (FSDP, FSDP2 and the
    engine), or the unit's modules that hold parameters, for DeepSpeed's ZeRO-3 and ZeRO++, which
    fetch each module's as it runs (6 in a GPT block: two layer norms, four linear layers).
    ``precision`` is the compute dtype; ``fp8`` runs the blocks' linear layers' matrix multiplies in
    fp8 with dynamic scaling (torchao's float8 training: activations, attention and the head stay
    bf16), and ``fp8_all_gather`` then gathers their weights in fp8, cast before the gather.
    ``reduce_precision`` defaults to fp32, as the engine reduces; ``wire`` is what collectives put
    on the wire between nodes, as ``shard(wire=...)`` and ``shardwire train --wire`` take it ("none",
    "int8", or pairs such as "params=int8,grads=int4,block=128": ``shardwire.comm.wire.Wire.parse``).
    ``diloco`` lets the groups of ``hybrid`` train apart and average their change every H steps, as
    ``shard(diloco=...)`` takes it ("none", or pairs such as "sync_every=50,fragments=4,wire=int4":
    ``shardwire.engine.diloco.DiLoCo.parse``); ``sync``, its name before, is read as ``diloco``
    with a warning, for a release.
    ``fault_tolerance``: the groups of ``hybrid`` are jobs of their own that meet through a quorum
    (``shard(fault_tolerance=...)``, ``shardwire train --fault-tolerance``); a DiLoCo sync that runs
    behind the steps then keeps the shards from before its eager step, to undo it if the quorum
    drops the sync (``shardwire.sim.memory``). Nothing else of the step changes.
    ``compile`` runs each unit's elementwise work fused (torch.compile), so it moves fewer bytes.
    ``recompute_fraction`` is the share of a block's forward FLOPs that backward recomputes under
    ``activation_checkpointing``, and of its activations forward does not keep: 1 (the default)
    for full checkpointing, the engine's; less for a selective policy (torchtitan's keeps the
    outputs of attention and of every other matrix multiplication).
    """

    micro_batch: int = 1
    grad_accum: int = 1
    reduce_each_micro_batch: bool = False
    layout: str = "full"
    shard_group_size: int | None = None
    prefetch: int = 2
    limiter: str = "sliding"
    gathers_per_unit: int = 1
    reduce_bucket_elements: int | None = None
    reshard_after_forward: bool | None = None
    precision: str = "bf16"
    reduce_precision: str = "fp32"
    fp8_all_gather: bool = False
    wire: str = "none"
    diloco: str = "none"
    fault_tolerance: bool = False
    compile: bool = False
    activation_checkpointing: bool = False
    recompute_fraction: float | None = None
    name: str = "custom"

    def __post_init__(self):
        _check_limits(self, "micro_batch", "grad_accum", "prefetch", "gathers_per_unit")
        _choice(self, "layout", LAYOUTS)
        _choice(self, "limiter", LIMITERS)
        _choice(self, "precision", PRECISIONS)
        _choice(self, "reduce_precision", REDUCE_PRECISIONS)
        if self.fp8_all_gather and self.precision != "fp8":
            raise SpecError("fp8_all_gather gathers the weights fp8 matrix multiplies read: it needs precision fp8")
        _ = self.wire_format  # a wire the engine refuses (a block too large, too) is this spec's error, now
        if uses_renamed_keys(self.diloco):  # read, with a warning, and kept under the new names
            object.__setattr__(self, "diloco", str(self.diloco_settings))
        given = f"{self.layout!r}{' (the default)' if self.layout == 'full' else ''}: give layout: hybrid"
        if self.diloco_settings is not None and self.layout != "hybrid":
            raise SpecError(f"diloco applies to layout 'hybrid', whose groups train apart between syncs, not {given}")
        if self.fault_tolerance and self.layout != "hybrid":
            raise SpecError(f"fault_tolerance carries the reductions between the groups of layout 'hybrid', not "
                            f"{given}")
        if self.shard_group_size is not None:
            _check_limits(self, "shard_group_size")
            if self.layout not in ("hybrid", "hybrid_secondary", "zero1"):
                raise SpecError(f"shard_group_size applies to layout 'hybrid', 'hybrid_secondary' and 'zero1', not "
                                f"{self.layout!r}")
        if self.layout == "zero1" and (ungathered := [key for key, value in (
                ("limiter", self.limiter != "sliding"), ("gathers_per_unit", self.gathers_per_unit != 1),
                ("fp8_all_gather", self.fp8_all_gather)) if value]):
            raise SpecError(f"{', '.join(ungathered)} set how parameters are gathered, and layout 'zero1' gathers "
                            f"none (every GPU holds them whole): leave {'it' if len(ungathered) == 1 else 'them'} out")
        if self.reduce_bucket_elements is not None:
            _check_limits(self, "reduce_bucket_elements")
            if self.layout != "zero1":
                raise SpecError(f"reduce_bucket_elements applies to layout 'zero1', whose all-reduces gather "
                                f"gradients into buckets; layout {self.layout!r} reduces each unit's")
        if self.recompute_fraction is not None:
            _check_limits(self, "recompute_fraction")
            if not self.activation_checkpointing:
                raise SpecError("recompute_fraction applies with activation_checkpointing true")
        if self.layout in ("grad_op", "zero1") and self.reshard_after_forward:
            raise SpecError(
                f"layout {self.layout!r} keeps parameters gathered from forward to backward, so "
                "reshard_after_forward cannot be true; use layout 'full' to reshard"
            )

    @property
    def reshards(self) -> bool:
        """Whether units are released after forward and gathered again for backward: as asked, or
        by default for every layout but ``grad_op`` and ``zero1``."""
        if self.reshard_after_forward is not None:
            return self.reshard_after_forward
        return self.layout not in ("grad_op", "zero1")

    @property
    def recomputed(self) -> float:
        """The share of a block's forward that backward recomputes: none without checkpointing."""
        if not self.activation_checkpointing:
            return 0.0
        return 1.0 if self.recompute_fraction is None else self.recompute_fraction

    @property
    def wire_format(self) -> Wire:
        """``wire`` parsed, or the reason it cannot be."""
        try:
            return Wire.parse(self.wire)
        except ValueError as err:
            raise SpecError(str(err)) from None

    @property
    def diloco_settings(self) -> DiLoCo | None:
        """``diloco`` parsed (None: synchronous training), or the reason it cannot be."""
        try:
            return DiLoCo.parse(self.diloco)
        except ValueError as err:
            raise SpecError(str(err)) from None

    @property
    def compute_bytes(self) -> int:
        """Bytes of an activation element: fp8 training keeps its activations in bf16."""
        return BYTES_PER_ELEMENT["bf16" if self.precision == "fp8" else self.precision]

    @property
    def gather_bytes(self) -> int:
        """Bytes of a gathered parameter element: in fp8 when weights are gathered in fp8."""
        return BYTES_PER_ELEMENT["fp8"] if self.fp8_all_gather else self.compute_bytes

    @property
    def reduce_bytes(self) -> int:
        return BYTES_PER_ELEMENT[self.reduce_precision]


SPECS = {"model": ModelSpec, "cluster": ClusterSpec, "training": TrainingSpec}
# Keys read under their names before a rename, with a warning, for a release: old -> new.
RENAMED_KEYS = {TrainingSpec: {"sync": "diloco", "sharding": "layout"}}


def parse(kind: str, mapping: Any, *, name: str | None = None):
    """Build the ``kind`` spec ("model", "cluster" or "training") from a mapping, or say what is wrong.

    ``name`` (a preset's or file's) labels the messages and becomes the spec's name unless the
    mapping gives one.
    """
    cls = SPECS[kind]
    if name and isinstance(mapping, Mapping) and "name" not in mapping:
        mapping = {**mapping, "name": name}
    return _build(cls, f"{kind} {name!r}" if name else kind, mapping)


def as_dict(spec) -> dict:
    """The spec as plain data (``parse`` reads it back)."""
    return dataclasses.asdict(spec)


def spelled(value) -> str:
    """A spec's value as a spec file writes it: true, false, none."""
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


MAX_NAME = 200  # characters of a spec's name


def _build(cls, label: str, mapping: Any):
    if not isinstance(mapping, Mapping):
        raise SpecError(f"{label} must be a mapping of keys to values, got {type(mapping).__name__}")
    mapping = _renamed(cls, label, mapping)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(mapping) - set(fields), key=shown)
    if unknown:
        meant = [close for key in unknown[:5] if isinstance(key, str) and (close := nearest(key, fields))]
        meant = f" (did you mean {', '.join(meant)}?)" if meant else ""
        if not meant and any(isinstance(key, str) and ":" in key for key in unknown[:5]):
            meant = " (YAML reads `key:value` as one key: put a space after the colon, `key: value`)"
        raise SpecError(f"{label}: unknown key(s) {', '.join(shown(key) for key in unknown[:5])}{meant}; known keys: "
                        f"{', '.join(fields)}")
    missing = [key for key, f in fields.items() if f.default is dataclasses.MISSING and key not in mapping]
    if missing:
        raise SpecError(f"{label}: missing key(s) {', '.join(missing)}")
    hints = typing.get_type_hints(cls)
    values = {key: _coerce(f"{label}: {key}", hints[key], value) for key, value in mapping.items()}
    if isinstance(name := values.get("name"), str) and len(name) > MAX_NAME:  # a report's header prints it whole
        raise SpecError(f"{label}: name {shown(name)} is {len(name):,} characters long: give one of at most {MAX_NAME}")
    try:
        return cls(**values)
    except SpecError as err:
        raise SpecError(f"{label}: {err}") from None


def _renamed(cls, label: str, mapping: Mapping) -> Mapping:
    """``mapping`` with the keys of ``cls`` given under their old names (``RENAMED_KEYS``) under the
    new ones, each with a warning; both names is an error."""
    renamed = {old: new for old, new in RENAMED_KEYS.get(cls, {}).items() if old in mapping}
    for old, new in renamed.items():
        if new in mapping:
            raise SpecError(f"{label}: {old} and {new} are the same key ({old} is its name before a rename): "
                            f"give {new} alone")
        warn_renamed(f"{label}: {old} is renamed {new}", stacklevel=4)
    return {renamed.get(key, key): value for key, value in mapping.items()} if renamed else mapping


def _coerce(where: str, hint, value):
    """Check ``value`` against the type ``hint`` (an int may stand for a float; a float that is a
    whole number for an int, as YAML writes ``1e3``)."""
    if isinstance(hint, types.UnionType):
        options = [h for h in typing.get_args(hint) if h is not type(None)]
        return None if value is None else _coerce(where, options[0], value)
    if dataclasses.is_dataclass(hint):
        return _build(hint, where, value)
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:  # past it, not one integer
            return int(value)
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    raise SpecError(f"{where} must be {_TYPE_NAMES[hint]}, got {shown(value)}")


_TYPE_NAMES = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}


def _check_limits(spec, *keys: str) -> None:
    """Refuse a value outside its ``LIMITS``: NaN and infinity first (no prediction can be made from
    such a rate, size or count, and a NaN time, which compares false with everything, would never
    let a transfer finish), then values beyond the bounds."""
    for key in keys:
        _check_value(key, getattr(spec, key))


def _check_value(key: str, value: float) -> None:
    """Refuse ``value`` of ``key`` outside its ``LIMITS``."""
    limit = LIMITS[key]
    written = f"{value:.12g}" if isinstance(value, float) else shown(value)  # 1e+15, not 1000000000000000.0
    if not (0 <= value if limit.zero else 0 < value) or not value < math.inf:
        raise SpecError(f"{key} must be {'at least 0' if limit.zero else 'positive'} and finite, got {written}")
    if value < limit.low:
        raise SpecError(f"{key} {written} is {limit.below}")
    if value > limit.high:
        raise SpecError(f"{key} {written} is {limit.above}")


def _choice(spec, key: str, choices: tuple[str, ...]) -> None:
    value = getattr(spec, key)
    if value not in choices:
        raise SpecError(f"{key} must be one of {', '.join(choices)}; got {shown(value)}")


def _given(value, default):
    """``value`` unless it was left out (None): a 0 given stays 0, for the checks to refuse."""
    return default if value is None else value


def _resolve(spec, **values) -> None:
    """Fill in defaults that depend on other keys (the dataclass is frozen once built)."""
    for key, value in values.items():
        object.__setattr__(spec, key, value)


# AWS p4d.24xlarge's 4 x 100 Gbps of EFA (p4de's are the same), from "Enable faster training with Amazon SageMaker
# data parallel library" (AWS Machine Learning Blog, December 2023; the SMDDP study). NCCL's all-gather reaches about
# 80% of the link's bandwidth (only at large buffers) and holds up to 24 of the A100's 108 SMs; SMDDP's reaches about
# 90% even at small buffers and holds 9. SMDDP implements AllGather (and AllReduce): the reduce-scatters of sharded
# training stay NCCL's, so they keep NCCL's 24 SMs, and one rate per level carries both (a little optimistic for the
# reductions). The latency per ring step is NCCL's own model's for the network (14 us, as every RDMA preset's).
P4D_LINE_GBPS = 400
P4D_NCCL = LinkSpec(busbw_GBps=0.8 * P4D_LINE_GBPS / 8, latency_us=14.0, compute_share=24 / SMS["A100"])
P4D_SMDDP = dataclasses.replace(P4D_NCCL, busbw_GBps=0.9 * P4D_LINE_GBPS / 8, all_gather_share=9 / SMS["A100"])


@dataclasses.dataclass(frozen=True)
class CollectiveLibrary:
    """What a collective library changes on a cluster whose presets describe NCCL, decided in one
    place, ``inter_node``, which every ``ClusterSpec`` runs as it is made (however it is made: a
    preset, a mapping, ``dataclasses.replace``), so that no spec can be half one library. Its
    figures live here, beside the spec that reads them, rather than among the presets, which are
    built of specs.

    A library measured on one network only is refused elsewhere rather than scaled to it: its
    figures are a rate and a share measured on that link, and set on another (a slower one, or
    Ethernet it does not run over) they would claim more than the link carries. ``network`` is that
    link as NCCL reaches it (the cluster preset's ``inter_node``), which the library's ``link``
    replaces; ``gpus`` the GPU presets it runs on; its refusals say where it runs (``runs_on``) and
    the cluster preset to start from (``preset``). An inter-node level that already names an
    ``all_gather_share`` was described for the library (its own figures, or a mapping's changes to
    them) and is kept: the figures a user gives win. Without a ``network`` (NCCL, whose figures
    every preset's are), the cluster's level is kept as it is."""

    name: str
    network: LinkSpec | None = None
    link: LinkSpec | None = None
    gpus: tuple[str, ...] | None = None
    runs_on: str = ""
    preset: str = ""

    def inter_node(self, cluster: ClusterSpec) -> LinkSpec:
        """``cluster``'s inter-node level as this library runs it, or why it cannot run there."""
        if self.gpus is not None and cluster.gpu not in self.gpus:
            raise SpecError(f"collectives {self.name} runs on {self.runs_on}, and {cluster.name!r} has {cluster.gpu}: "
                            f"start from preset {self.preset}")
        if self.network is None or cluster.inter_node.all_gather_share is not None:
            return cluster.inter_node
        if cluster.inter_node == self.network:
            return self.link
        raise SpecError(f"collectives {self.name} runs on {self.runs_on}, and {cluster.name!r} has another network "
                        f"between nodes: start from preset {self.preset}")


# Read as each ClusterSpec is made. Every cluster preset's figures are NCCL's (see each). SMDDP runs on P4d and
# P4de instances only (SageMaker's developer guide, "Compatibility with the SMDDP library optimized for AWS
# infrastructure"): A100s over p4d's EFA.
COLLECTIVES: dict[str, CollectiveLibrary] = {c.name: c for c in (
    CollectiveLibrary("nccl"),
    CollectiveLibrary("smddp", network=P4D_NCCL, link=P4D_SMDDP, gpus=("a100-40gb", "a100-80gb"),
                      runs_on="AWS p4d and p4de only (A100s over 4 x 100 Gbps of EFA; p4de: gpu a100-80gb)",
                      preset="a100-efa-400"),
)}
