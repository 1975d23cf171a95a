"""The compute model: how long a unit's forward and backward take on the cluster's GPU, kernel by kernel.

One constant fraction of peak cannot describe a step: a GPU runs large matrix multiplies near its
peak, small and skinny ones well below it, and a good share of a step is not matrix work at all but
kernels bound by memory bandwidth (norms, activations, residual adds, eager attention's softmax,
casts, the optimizer step). So each kind of kernel is timed on the resource that bounds it
(``shardwire.sim.architecture`` lists each unit's kernels):

* a matrix multiply of (m x k) by (k x n) takes its FLOPs at ``matmul_efficiency`` of the dtype's
  dense peak plus its bytes (both inputs and the output) at ``memory_efficiency`` of the memory
  bandwidth: an additive roofline, so a large multiply runs near ``matmul_efficiency`` of peak and a
  small or skinny one (low FLOPs per byte) falls toward the memory's rate. Backward runs two of the
  same sizes (the input's gradient, then the weight's);
* fused attention (FlashAttention through SDPA) is one kernel at ``attention_efficiency`` of the
  peak, computing only the unmasked half of a causal score matrix; its backward does 2.5 times its
  forward's FLOPs, as it recomputes the scores (Dao 2023, FlashAttention-2, section 4.1). Eager
  attention is two batched matrix multiplies per head (timed as above) and a softmax over the
  materialized scores: 4 passes over them in forward (scale and mask, softmax: each a read and a
  write), 6 in backward;
* memory-bound kernels move their bytes at ``memory_efficiency`` of the bandwidth, eager or fused
  by torch.compile (``compile``); backward moves twice forward's bytes (it reads what forward read
  and the gradient, and writes the gradient);
* fp8 training (torchao's float8 with dynamic tensorwise scaling) runs each linear layer's multiply
  at ``FP8_MATMUL_RELATIVE`` of the fraction of the fp8 peak that bf16 multiplies reach of theirs
  (fp8 kernels fall further short of a peak twice as high), and reads each input once more to
  scale it and writes it in fp8 (``2 c + 1``
  bytes per element): the activation and the weight in forward (the weight already cast when it is
  gathered in fp8), the output gradient in backward, which also transposes both fp8 operands of the
  weight's gradient (read and write one byte each);
* the optimizer step (AdamW, fp32 states) streams ``OPTIMIZER_BYTES_PER_PARAM`` per parameter of
  the GPU's shard, as other memory-bound work does, or at the rate measured of it
  (``optimizer_GBps``);
* the engine's copies (``shardwire.engine.packing``), as FSDP2 makes them: each gather of a unit
  over more than one rank is copied out of rank order into parameter order (a read and a write of
  its compute-dtype parameters), and each gradient back in rank by rank for its reduce-scatter (a
  read in the compute dtype, a write in the reduction dtype).

Without a memory bandwidth (a cluster that gives none) every byte term is left out. What the model
does not see: host overheads and kernel launches, the GPU's clock under power limits (part of the
preset's efficiencies), and the tile and wave quantization of particular shapes.
"""

from __future__ import annotations

from shardwire.sim.architecture import ROOT, Attention, Matmul, UnitCost
from shardwire.sim.specs import BYTES_PER_ELEMENT, ClusterSpec, TrainingSpec

# An Adam step reads the fp32 master weight, its gradient and both moments, and writes the weight
# and the moments.
OPTIMIZER_BYTES_PER_PARAM = 28
# FlashAttention-2's backward: 2.5 x its forward's FLOPs (5 matrix multiplies to forward's 2).
FLASH_BACKWARD = 2.5
# Passes over eager attention's score matrix, each reading or writing it once: forward (scale and
# mask, softmax), backward (the softmax's gradient, the mask's).
SOFTMAX_PASSES = (4, 6)
# Backward moves this many times forward's bytes in memory-bound kernels.
ELEMENTWISE_BACKWARD = 2
# fp8 matrix multiplies reach this part of the efficiency bf16 ones reach (of the fp8 peak): with it
# and the casts priced below, a float8 linear's forward and backward at M, K, N = 4096, 8192, 16384
# runs 1.39 times as fast as in bf16 on an H100 at 0.70-0.75 of its bf16 peak, torchao's own H100
# microbenchmark (torchao/float8/README.md, "Performance", example 2), where the peaks alone would
# give 1.7.
FP8_MATMUL_RELATIVE = 0.8


def forward_s(unit: UnitCost, cluster: ClusterSpec, training: TrainingSpec) -> float:
    """Seconds of a unit's forward over one micro-batch."""
    b = training.micro_batch
    matmuls = sum(_matmul_s(m, b, cluster, training) + _fp8_casts_s(m, b, cluster, training, backward=False)
                  for m in unit.matmuls)
    attention = sum(_attention_s(a, b, cluster, training, backward=False) for a in unit.attention)
    return matmuls + attention + _memory_s(_elementwise_bytes(unit, training) * b, cluster)


def backward_s(unit: UnitCost, cluster: ClusterSpec, training: TrainingSpec) -> float:
    """Seconds of a unit's backward over one micro-batch, with the recomputation of its forward (or
    the part a selective policy recomputes) under activation checkpointing; the root is not
    checkpointed."""
    b = training.micro_batch
    matmuls = sum(2 * _matmul_s(m, b, cluster, training) + _fp8_casts_s(m, b, cluster, training, backward=True)
                  for m in unit.matmuls)
    attention = sum(_attention_s(a, b, cluster, training, backward=True) for a in unit.attention)
    elementwise = _memory_s(ELEMENTWISE_BACKWARD * _elementwise_bytes(unit, training) * b, cluster)
    recompute = 0.0 if unit.name == ROOT else training.recomputed
    return matmuls + attention + elementwise + recompute * forward_s(unit, cluster, training)


def optimizer_s(params: float, cluster: ClusterSpec) -> float:
    """Seconds of an Adam step over ``params`` parameters (one GPU's shard)."""
    if cluster.optimizer_GBps is not None:
        return OPTIMIZER_BYTES_PER_PARAM * params / (cluster.optimizer_GBps * 1e9)
    return _memory_s(OPTIMIZER_BYTES_PER_PARAM * params, cluster)


def copy_out_s(unit: UnitCost, ranks: int, cluster: ClusterSpec, training: TrainingSpec) -> float:
    """Seconds to copy a unit gathered over ``ranks`` out into parameter order (none from one rank)."""
    return 0.0 if ranks == 1 else _memory_s(2 * unit.params * training.compute_bytes, cluster)


def copy_in_s(unit: UnitCost, ranks: int, cluster: ClusterSpec, training: TrainingSpec) -> float:
    """Seconds to copy a unit's gradient in rank by rank for a reduce-scatter over ``ranks``."""
    return 0.0 if ranks == 1 else _memory_s(unit.params * (training.compute_bytes + training.reduce_bytes), cluster)


def _matmul_s(m: Matmul, batch: int, cluster: ClusterSpec, training: TrainingSpec) -> float:
    dtype = training.precision if m.linear or training.precision != "fp8" else "bf16"
    rows = m.rows * batch
    inputs = BYTES_PER_ELEMENT[dtype]
    output = BYTES_PER_ELEMENT["bf16" if dtype == "fp8" else dtype]
    flops = 2 * rows * m.k * m.n
    nbytes = inputs * (rows * m.k + m.k * m.n) + output * rows * m.n
    efficiency = cluster.matmul_efficiency * (FP8_MATMUL_RELATIVE if dtype == "fp8" else 1.0)
    compute = flops / (cluster.matmul_tflops(dtype) * 1e12 * efficiency)
    return m.count * (compute + _memory_s(nbytes, cluster))


def _fp8_casts_s(m: Matmul, batch: int, cluster: ClusterSpec, training: TrainingSpec, *, backward: bool) -> float:
    if training.precision != "fp8" or not m.linear:
        return 0.0
    rows, scaled = m.rows * batch, 2 * training.compute_bytes + BYTES_PER_ELEMENT["fp8"]
    if backward:
        nbytes = rows * m.n * scaled + 2 * rows * (m.k + m.n)
    else:
        nbytes = rows * m.k * scaled + (0 if training.fp8_all_gather else m.k * m.n * scaled)
    return m.count * _memory_s(nbytes, cluster)


def _attention_s(a: Attention, batch: int, cluster: ClusterSpec, training: TrainingSpec, *, backward: bool) -> float:
    dtype = "bf16" if training.precision == "fp8" else training.precision
    if a.eager:
        scores = Matmul(a.queries, a.head_dim, a.keys, count=a.heads, linear=False)
        weighted = Matmul(a.queries, a.keys, a.head_dim, count=a.heads, linear=False)
        matmuls = (_matmul_s(scores, batch, cluster, training) + _matmul_s(weighted, batch, cluster, training))
        softmax = a.heads * a.queries * a.keys * batch * training.compute_bytes * SOFTMAX_PASSES[backward]
        return (2 if backward else 1) * matmuls + _memory_s(softmax, cluster)
    executed = a.flops * batch * (0.5 if a.causal else 1.0)
    seconds = executed / (cluster.matmul_tflops(dtype) * 1e12 * cluster.attention_efficiency)
    return FLASH_BACKWARD * seconds if backward else seconds


def _elementwise_bytes(unit: UnitCost, training: TrainingSpec) -> float:
    return unit.fused_bytes if training.compile else unit.elementwise_bytes


def _memory_s(nbytes: float, cluster: ClusterSpec) -> float:
    if cluster.memory_bandwidth_GBps is None:
        return 0.0
    return nbytes / (cluster.memory_bandwidth_GBps * 1e9 * cluster.memory_efficiency)
