"""Named models, GPUs, clusters and training configurations, with where each figure comes from
(docs/simulator.md, "Presets and their sources", has the same; docs/benchmarks/simulator.md the published runs
they meet).

Models: the published configurations (layers, hidden, heads, MLP width, vocabulary, context).
Biases are left out of parameter counts (under 0.2% of any of these models).

* The project's GPT sizes, as ``shardwire train --model`` names them (``shardwire.sim.gpt_sizes``).
* GPT-2 (Radford et al. 2019; Hugging Face ``gpt2``, ``gpt2-medium``, ``gpt2-large``, ``gpt2-xl``
  configs): 1024 learned positions, 50257-token vocabulary, head tied to the embedding.
* MPT (LLM Foundry's ``mpt-*.yaml``, as its throughput tables ran them): GPT-style blocks with
  a 4 h MLP, 50368-token vocabulary, 2048 learned positions (the tables' parameter counts grow
  with the sequence), one-kernel LayerNorm, flash attention.
* T5-3B and T5-11B: T5 v1.1 XL and XXL (Hugging Face ``google/t5-v1_1-xl``, ``-xxl`` configs: gated
  GELU MLP, untied head, RMSNorm), the models whose FLOPs the T5 document's appendix counts (its
  "15 B s h^2" feed-forward is v1.1's gated MLP with f = 2.5 h). Sequence lengths 512 in, 150 out,
  and eager attention: the FSDP T5 example (pytorch/examples, distributed/FSDP/T5_training.py)
  that the document says it started from trains Hugging Face's T5 on WikiHow with those lengths.
* Llama 2 7B, 13B, 70B (Touvron et al. 2023, table 1 and the released ``params.json``): SwiGLU MLP,
  RMSNorm, rotary positions, untied head, 4096-token context, grouped-query attention for 70B.
* Llama 3.1 8B and Llama 3 70B (Meta's released ``params.json``), at torchtitan's training context
  of 8192 tokens.
* GPT 18B: the model of DeepSpeed's ZeRO++ tutorial (docs/_tutorials/zeropp.md: Megatron-DeepSpeed's
  GPT, ``--num-layers 40 --hidden-size 6144 --num-attention-heads 32 --seq-length 512``), GPT-2's
  vocabulary and learned positions, attention unfused (no flash attention on a V100).
* InternLM 7B (InternLM/InternLM at fa7337b, ``configs/7B_sft.py`` and ``internlm/model``): 32 blocks
  of hidden 4096, 32 heads, MLP ratio 8/3 rounded up to a multiple of 256 (SwiGLU of 11008),
  RMSNorm, rotary positions, 103168-token vocabulary, untied head, flash attention; 2048 tokens as
  its performance tables ran it. No count stated: the architecture's is 7.3B.

GPUs: dense peaks per dtype from NVIDIA's data sheets (``shardwire.gpus``), memory and its bandwidth
likewise (the V100's tensor cores take fp16 and no bf16: its presets refuse ``precision: bf16``);
the fractions of them kernels reach, the compute model's (``shardwire.sim.compute``):

* matrix multiplies: one number per GPU, set against its published runs (the A100's eleven,
  MosaicML's two H100 SXM runs, torchtitan's six on Grand Teton's 500 W H100s) and, for the H200,
  calibrated from a profile measured on one (``benchmarks/results/gpu/h200-profiles``);
* attention: FlashAttention-2 reaches 50 to 73% of an A100's peak (Dao 2023) and about 35% of an
  H100's (Shah et al. 2024, FlashAttention-3);
* memory-bound kernels at 0.85 of the bandwidth (a device-to-device copy moves 0.90 on H100 and
  H200);
* quantization kernels (a quantized wire's encode and decode): elementwise, at about
  ``QUANTIZE_BYTES_PER_ELEMENT`` = 10 bytes of memory traffic per element (encoding with error
  feedback reads the value and its fp32 residual and writes a byte and the residual; decoding reads
  a byte and writes fp32): the bandwidth / 10 elements per second. A fused kernel's figure: the
  torch operations of ``shardwire.comm.quantize`` make several passes and may reach less.

The V100's matrix multiplies are set against the ZeRO++ blog's runs at 800 Gbit/s, the least
network-bound of them (each node's NICs busy 5-20% of the step).
``h100-grand-teton`` is the machine of torchtitan's published runs (its docs/performance.md): H100s
with 96 GB of HBM2e at 2.4 TB/s and a 500 W limit, given the SXM's peaks as torchtitan's MFU is.

Clusters: 8-GPU nodes, NVLink 600 GB/s per GPU in both directions on A100, 900 on H100; NVIDIA
DGX-2: 16 V100 SXM3 32 GB joined by NVSwitch, 300 GB/s per GPU in both directions (six NVLink 2
links), and eight 100 Gb/s InfiniBand NICs. Assumed, not measured:

* intra-node busbw: 80% of one direction of NVLink (240 GB/s on A100, 360 GB/s on H100), what
  nccl-tests typically reports for all-gather on such nodes;
* inter-node busbw: TCP over Ethernet delivers 60% of the line rate (the T5 document's 120 of
  2 x 100 Gbps usable); RDMA (EFA, InfiniBand, RoCE) 90%;
* latency per collective step: NVLink 3.4 us and RDMA 14 us (NCCL's own tuning model,
  src/graph/tuning.cc, ring/simple); TCP 50 us (kernel TCP round trips of 20-30 us plus NCCL's
  socket proxy);
* compute a collective takes while it runs (``compute_share``): the SMs its channels hold, one per
  channel, over the GPU's. Within a node, NCCL's ring runs 2 channels per NVLink (24 channels for
  the A100's 12 NVLinks, as NCCL's maintainers describe DGX A100 in NVIDIA/nccl#1225: 24 of 108
  SMs, 0.22); on the H100's 18 NVLinks that rule gives 36, capped at NCCL's 32 channels (32 of 132,
  0.24), and on the V100's 6 NVLinks 12 (12 of 80 SMs, 0.15). Across nodes a ring's channels follow
  the NICs, 2 per NIC (NVIDIA/nccl#689: "2 is the minimum" for a single NIC), and are never more
  than the node's NVLinks carry. Memory bandwidth the kernels take is left out.

Training: the four T5 runs of the document (see docs/benchmarks/simulator.md for what it states and
what is assumed), torchtitan's Llama 3.1 8B runs with FSDP2 (its docs/performance.md, tables 1 and 3: local
batch 2, selective activation checkpointing; eager, with torch.compile, and with both and float8,
its weights gathered in fp8), and ``default``. torchtitan's selective policy ("op") keeps the
outputs of attention and of every other matrix multiplication, so backward recomputes half of a
block's matrix multiplications: for Llama 3.1 8B at 8192 tokens, 218M of the 570M forward FLOPs per
token and block, a ``recompute_fraction`` of 0.38. FSDP2 gathers one unit ahead (``prefetch`` 1)
and reduces in fp32 (torchtitan's default).
"""

from __future__ import annotations

import dataclasses

from shardwire.gpus import DATASHEET_TFLOPS, NO_BF16, SMS
from shardwire.renamed import warn_renamed
from shardwire.sim import specs
from shardwire.sim.gpt_sizes import PRESETS as GPT_SIZES
from shardwire.sim.specs import P4D_NCCL, ClusterSpec, LinkSpec, ModelSpec, TrainingSpec

_GPT2 = dict(vocab=50257, seq_len=1024, learned_positions=True)
_MPT = dict(vocab=50368, seq_len=2048, learned_positions=True)
_T5 = dict(kind="encoder-decoder", vocab=32128, seq_len=512, decoder_seq_len=150, ffn_gated=True,
           tied_embeddings=False, attention="eager", norm="rmsnorm")
_LLAMA2 = dict(vocab=32000, seq_len=4096, ffn_gated=True, tied_embeddings=False, norm="rmsnorm")
_LLAMA3 = dict(vocab=128256, seq_len=8192, ffn_gated=True, tied_embeddings=False, norm="rmsnorm")

MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    *(config.spec(name) for name, config in GPT_SIZES.items()),  # what `shardwire train --model` names
    ModelSpec(name="gpt2-125m", layers=12, hidden=768, heads=12, params=124_000_000, **_GPT2),
    ModelSpec(name="gpt2-350m", layers=24, hidden=1024, heads=16, params=355_000_000, **_GPT2),
    ModelSpec(name="gpt2-760m", layers=36, hidden=1280, heads=20, params=774_000_000, **_GPT2),
    ModelSpec(name="gpt2-1.5b", layers=48, hidden=1600, heads=25, params=1_558_000_000, **_GPT2),
    ModelSpec(name="mpt-125m", layers=12, hidden=768, heads=12, params=125_000_000, **_MPT),
    ModelSpec(name="mpt-1b", layers=24, hidden=2048, heads=16, params=1_316_000_000, **_MPT),
    ModelSpec(name="mpt-7b", layers=32, hidden=4096, heads=32, params=6_659_000_000, **_MPT),
    ModelSpec(name="mpt-13b", layers=40, hidden=5120, heads=40, params=12_854_000_000, **_MPT),
    ModelSpec(name="mpt-30b", layers=48, hidden=7168, heads=56, params=29_975_000_000, **_MPT),
    ModelSpec(name="mpt-70b", layers=80, hidden=8192, heads=64, **_MPT),  # mpt-70b.yaml; its table gives no count
    ModelSpec(name="t5-3b", layers=24, hidden=2048, heads=32, ffn_hidden=5120, params=2_850_000_000, **_T5),
    ModelSpec(name="t5-11b", layers=24, hidden=4096, heads=64, ffn_hidden=10240, params=11_100_000_000, **_T5),
    ModelSpec(name="llama2-7b", layers=32, hidden=4096, heads=32, ffn_hidden=11008, params=6_740_000_000, **_LLAMA2),
    ModelSpec(name="llama2-13b", layers=40, hidden=5120, heads=40, ffn_hidden=13824, params=13_000_000_000, **_LLAMA2),
    # Code Llama 34B's shape (Meta did not release a Llama 2 34B): fms-fsdp's "34b" llama2 variant.
    ModelSpec(name="llama2-34b", layers=48, hidden=8192, heads=64, kv_heads=8, ffn_hidden=22016,
              params=33_700_000_000, **_LLAMA2),
    ModelSpec(name="llama2-70b", layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672,
              params=69_000_000_000, **_LLAMA2),
    ModelSpec(name="llama3.1-8b", layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336,
              params=8_030_000_000, **_LLAMA3),
    ModelSpec(name="llama3-70b", layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672,
              params=70_550_000_000, **_LLAMA3),
    ModelSpec(name="gpt-18b", layers=40, hidden=6144, heads=32, vocab=50257, seq_len=512, learned_positions=True,
              attention="eager", params=18_000_000_000),
    ModelSpec(name="internlm-7b", layers=32, hidden=4096, heads=32, ffn_hidden=11008, vocab=103168, seq_len=2048,
              ffn_gated=True, tied_embeddings=False, norm="rmsnorm"),
)}

QUANTIZE_BYTES_PER_ELEMENT = 10


def _gpu(name: str, sheet: str, memory_gb: float, hbm_GBps: float, *, matmul: float, attention: float,
         memory: float) -> dict:
    """A GPU preset: the data sheet's dense peaks, its memory and bandwidth, the fractions of them its
    kernels reach, and the quantization kernels' rate its bandwidth allows."""
    peaks = DATASHEET_TFLOPS[sheet]
    return dict(gpu=name, peak_tflops=peaks["bf16"], fp8_tflops=peaks.get("fp8"), fp32_tflops=peaks["fp32"],
                bf16=sheet not in NO_BF16,
                gpu_memory_gb=memory_gb, memory_bandwidth_GBps=hbm_GBps, matmul_efficiency=matmul,
                attention_efficiency=attention, memory_efficiency=memory,
                quantize_gelems=hbm_GBps / QUANTIZE_BYTES_PER_ELEMENT)


GPUS: dict[str, dict] = {g["gpu"]: g for g in (
    _gpu("a100-80gb", "A100", 80.0, 2039.0, matmul=0.75, attention=0.60, memory=0.85),
    _gpu("a100-40gb", "A100", 40.0, 1555.0, matmul=0.75, attention=0.60, memory=0.85),
    _gpu("h100-sxm", "H100", 80.0, 3350.0, matmul=0.58, attention=0.40, memory=0.85),
    _gpu("h100-grand-teton", "H100", 96.0, 2400.0, matmul=0.50, attention=0.40, memory=0.85),
    _gpu("h200", "H200", 140.0, 4800.0, matmul=0.75, attention=0.52, memory=0.85),
    _gpu("v100-32gb", "V100", 32.0, 900.0, matmul=0.55, attention=0.50, memory=0.85),
)}

A100_SMS, H100_SMS, V100_SMS = SMS["A100"], SMS["H100"], SMS["V100"]
_NVLINK3 = LinkSpec(busbw_GBps=240.0, latency_us=3.4, compute_share=24 / A100_SMS)
_NVLINK4 = LinkSpec(busbw_GBps=360.0, latency_us=3.4, compute_share=32 / H100_SMS)
_A100_80 = dict(gpus_per_node=8, intra_node=_NVLINK3, **GPUS["a100-80gb"])
_A100_40 = dict(gpus_per_node=8, intra_node=_NVLINK3, **GPUS["a100-40gb"])
_H100 = dict(gpus_per_node=8, intra_node=_NVLINK4, **GPUS["h100-sxm"])
_GRAND_TETON = dict(gpus_per_node=8, intra_node=_NVLINK4, **GPUS["h100-grand-teton"])
_H200 = dict(gpus_per_node=8, intra_node=_NVLINK4, **GPUS["h200"])  # the H200's SMs are the H100's
_DGX2 = dict(gpus_per_node=16, intra_node=LinkSpec(busbw_GBps=120.0, latency_us=3.4, compute_share=12 / V100_SMS),
             **GPUS["v100-32gb"])


def _channels(nics: int, sms: int) -> float:
    """The compute share of a ring across nodes: two channels per NIC, an SM each."""
    return 2 * nics / sms


def _tcp(gbps: float, sms: int, nics: int = 1) -> LinkSpec:
    return LinkSpec(busbw_GBps=0.6 * gbps / 8, latency_us=50.0, compute_share=_channels(nics, sms))


def rdma_link(gbps: float, sms: int, nics: int = 1) -> LinkSpec:
    """``nics`` RDMA NICs (InfiniBand, RoCE, EFA) of ``gbps`` in all, serving GPUs of ``sms`` SMs."""
    return LinkSpec(busbw_GBps=0.9 * gbps / 8, latency_us=14.0, compute_share=_channels(nics, sms))


CLUSTERS: dict[str, ClusterSpec] = {c.name: c for c in (
    # The T5 document's IBM Cloud system: 2 x 100 GbE per node, 120 Gbps usable (stated).
    ClusterSpec(name="ibm-a100-ethernet", nodes=8, **_A100_80, inter_node=LinkSpec(
        busbw_GBps=15.0, latency_us=50.0, compute_share=_channels(2, A100_SMS))),
    # The same system after its 2023 upgrade: RoCE with GPUDirect RDMA, 400 Gbps per node as fms-fsdp's
    # tables state it; the H100 cluster of the same tables, 800 Gbps per node.
    ClusterSpec(name="ibm-a100-roce", nodes=16, inter_node=rdma_link(400, A100_SMS, nics=2), **_A100_80),
    ClusterSpec(name="ibm-h100-rdma-800", nodes=12, inter_node=rdma_link(800, H100_SMS, nics=2), **_H100),
    ClusterSpec(name="a100-100gbe", nodes=8, inter_node=_tcp(100, A100_SMS), **_A100_80),
    # InternLM's performance tables (doc/en/train_performance.md): A100-SXM4-80GB nodes with 4 x 100 Gb RoCE.
    ClusterSpec(name="a100-80gb-roce-400", nodes=128, inter_node=rdma_link(400, A100_SMS, nics=4), **_A100_80),
    # AWS p4d.24xlarge: 4 x 100 Gbps of EFA. NCCL's all-gather across its nodes, as SageMaker's SMDDP study
    # measured it: about 80% of the link, holding up to 24 of the A100's 108 SMs (P4D_NCCL, above).
    ClusterSpec(name="a100-efa-400", nodes=8, inter_node=P4D_NCCL, **_A100_40),
    ClusterSpec(name="a100-ib-200", nodes=8, inter_node=rdma_link(200, A100_SMS), **_A100_80),
    # 8 x 200 Gb/s of RDMA per node: MosaicML's A100 clusters (RoCE, stated with their throughput table).
    ClusterSpec(name="a100-80gb-rdma-1600", nodes=1, inter_node=rdma_link(1600, A100_SMS, nics=8), **_A100_80),
    ClusterSpec(name="a100-40gb-rdma-1600", nodes=16, inter_node=rdma_link(1600, A100_SMS, nics=8), **_A100_40),
    ClusterSpec(name="h100-100gbe", nodes=8, inter_node=_tcp(100, H100_SMS), **_H100),
    ClusterSpec(name="h100-400gbe", nodes=8, inter_node=_tcp(400, H100_SMS), **_H100),
    ClusterSpec(name="h100-ib-400", nodes=8, inter_node=rdma_link(400, H100_SMS), **_H100),
    ClusterSpec(name="h100-rdma-3200", nodes=1, inter_node=rdma_link(8 * 400, H100_SMS, nics=8), **_H100),
    ClusterSpec(name="h100-grand-teton", nodes=16, inter_node=rdma_link(8 * 400, H100_SMS, nics=8), **_GRAND_TETON),
    # AWS p5.48xlarge: 3200 Gbps of EFA per node, 400 for each GPU (4 NICs of 100), counted as 8 rails.
    ClusterSpec(name="h100-efa-3200", nodes=4, inter_node=rdma_link(8 * 400, H100_SMS, nics=8), **_H100),
    # torchtitan's H200 benchmark (Trainy on WhiteFiber): 400 Gb/s of RDMA per GPU (ConnectX-7).
    ClusterSpec(name="h200-rdma-3200", nodes=4, inter_node=rdma_link(8 * 400, H100_SMS, nics=8), **_H200),
    # NVIDIA DGX-2s with all eight of their 100 Gb/s InfiniBand NICs (the ZeRO++ blog's runs used 1 to 8);
    # a ring across nodes runs through each node's NVLinks too, so it has no more channels than they carry.
    ClusterSpec(name="v100-dgx2-ib-800", nodes=24, **_DGX2,
                inter_node=dataclasses.replace(rdma_link(800, V100_SMS, nics=8), compute_share=12 / V100_SMS)),
)}

# The T5 document's runs: BF16 with BF16 reductions (the FSDP example's policy), activation
# checkpointing, one unit per T5 block, and FSDP's rate limiter, which allows two all-gathers in
# flight (prefetch 2), as a block-and-flush limiter at first and as a sliding window at the end.
# T5-11B's batches are the document's; T5-3B's is not stated, only that every batch was maximized:
# 215 is the largest that needs no more memory on one node than T5-11B at 50 (a test keeps it so).
_IBM_T5 = dict(precision="bf16", reduce_precision="bf16", activation_checkpointing=True, prefetch=2)
# torchtitan's FSDP2 runs: one unit gathered ahead, fp32 reductions, its selective ("op") policy.
_TORCHTITAN = dict(micro_batch=2, prefetch=1, precision="bf16", reduce_precision="fp32",
                   activation_checkpointing=True, recompute_fraction=0.38)

TRAININGS: dict[str, TrainingSpec] = {t.name: t for t in (
    TrainingSpec(name="default"),
    TrainingSpec(name="ibm-t5-3b", micro_batch=215, limiter="sliding", **_IBM_T5),
    TrainingSpec(name="ibm-t5-11b-batch20-block", micro_batch=20, limiter="block", **_IBM_T5),
    TrainingSpec(name="ibm-t5-11b-batch50-block", micro_batch=50, limiter="block", **_IBM_T5),
    TrainingSpec(name="ibm-t5-11b-batch50-sliding", micro_batch=50, limiter="sliding", **_IBM_T5),
    TrainingSpec(name="torchtitan-llama3.1-8b", **_TORCHTITAN),
    TrainingSpec(name="torchtitan-llama3.1-8b-compile", compile=True, **_TORCHTITAN),
    TrainingSpec(name="torchtitan-llama3.1-8b-float8", compile=True, fp8_all_gather=True,
                 **dict(_TORCHTITAN, precision="fp8")),
)}

PRESETS = {"model": MODELS, "cluster": CLUSTERS, "training": TRAININGS}


# Moved to ``shardwire.sim.specs`` beside the ``ClusterSpec`` that reads them: still found here for a
# release, with a warning naming their home.
_MOVED_TO_SPECS = frozenset({"COLLECTIVES", "CollectiveLibrary", "P4D_LINE_GBPS", "P4D_SMDDP"})


def __getattr__(name: str):
    if name in _MOVED_TO_SPECS:
        warn_renamed(f"shardwire.sim.presets.{name} is now shardwire.sim.specs.{name}")
        return getattr(specs, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
