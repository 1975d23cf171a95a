"""The published results the simulator must reproduce with one model (the presets' compute model and
networks, no setting per point): measured throughput of FSDP, HSDP and FSDP2 training at scale on
A100s, H100s and H200s, and of DeepSpeed's ZeRO-3 and ZeRO++ on V100s (``PUBLISHED``;
docs/benchmarks/simulator.md cites each source and what it states), and the scaling of T5 on IBM
Cloud (../shared/seeds/000).

Throughput: every point within ``TOLERANCE`` of its published tokens per second per GPU, most
within ``MOST``, but those whose ``miss`` says why the simulator misses them: they are expected to,
strictly (one that starts passing fails until its mark goes). In at least a dozen of the runs each
node's NICs are busy for a third of the step or more. T5: 8 x A100-80GB per node, ~120 Gbps of usable Ethernet between nodes, BF16,
activation checkpointing. T5-3B scales at about 95% from 1 to 64 nodes; T5-11B scales poorly with a
small batch and a block-and-flush limiter, better with the larger batch the limiter made room for
(>75% at 32 nodes), and with a sliding window reaches about 90% at 32 nodes and 80% at 64. The
model must land within 10 points of each end figure and put the others in the document's order.
"""

import dataclasses

import pytest

from shardwire.sim.memory import GIB
from shardwire.sim.predict import predict, sweep
from shardwire.sim.architecture import architecture
from shardwire.sim.presets import CLUSTERS, MODELS, TRAININGS, V100_SMS, rdma_link
from shardwire.sim.specs import LinkSpec, TrainingSpec, as_dict, parse

# Every published figure is predicted within this, and most within ``MOST``.
TOLERANCE = 0.15
MOST = 0.10


@dataclasses.dataclass(frozen=True)
class Point:
    """A published run: what ran where, and the tokens per second per GPU it measured."""

    source: str
    model: str
    cluster: str
    gpus: int
    training: dict
    tokens_per_s: float
    memory_gib: float | None = None  # peak memory per GPU, where published
    miss: str | None = None  # why the simulator misses it: the test expects it to, until it no longer does
    inter_node: LinkSpec | None = None  # the NICs the run used, where fewer than its cluster's nodes have

    def predict(self):
        cluster = CLUSTERS[self.cluster]
        if self.inter_node is not None:
            cluster = dataclasses.replace(cluster, inter_node=self.inter_node)
        cluster = parse("cluster", {**as_dict(cluster), "nodes": self.gpus // cluster.gpus_per_node})
        training = self.training if isinstance(self.training, TrainingSpec) else TrainingSpec(**self.training)
        return predict(MODELS[self.model], cluster, training)

    def predicted_tokens_per_s(self) -> float:
        p = self.predict()
        return p.training.micro_batch * p.training.grad_accum * p.model.seq_len / p.step_time_s


# torchtitan's selective ("op") checkpointing recomputes 38% of a Llama block's forward FLOPs.
SELECTIVE = dict(activation_checkpointing=True, recompute_fraction=0.38)
FULL = dict(activation_checkpointing=True)
# Composer (LLM Foundry) reduce-scatters every micro-batch's gradients: it runs FSDP without no_sync.
COMPOSER = dict(reduce_each_micro_batch=True)
_TORCHTITAN_LLAMA3 = {key: value for key, value in as_dict(TRAININGS["torchtitan-llama3.1-8b"]).items() if key != "name"}
_TORCHTITAN_FLOAT8 = {key: value for key, value in as_dict(TRAININGS["torchtitan-llama3.1-8b-float8"]).items()
                      if key != "name"}
# Backward recomputing every linear layer's forward and keeping attention's: 436M of Llama 3.1 8B's 570M
# forward FLOPs per token and block, twice what torchtitan's op policy recomputes (0.38) where it keeps half.
_LINEARS_RECOMPUTED = dict(activation_checkpointing=True, recompute_fraction=0.76)


def _megatron_tokens_per_s(tflops: float, model: str) -> float:
    """Tokens per second per GPU from TFLOP/s as Megatron-DeepSpeed counts them with activation
    recomputation (Narayanan et al. 2021): 96 l h^2 (1 + s / 6h + V / 16lh) FLOPs per token."""
    m = MODELS[model]
    return tflops * 1e12 / (96 * m.layers * m.hidden ** 2 * (1 + m.seq_len / (6 * m.hidden)
                                                               + m.vocab / (16 * m.layers * m.hidden)))


# DeepSpeed's ZeRO-3 and ZeRO++ in fp16 on V100s: each block's parameters fetched module by module (six
# collectives: two layer norms, four linear layers), the next module's ahead, gradients reduced in fp16;
# ZeRO++ (the tutorial's config) adds its quantized weights (int8) and gradients (int4) across nodes and
# the secondary copy within each 16-GPU node that backward gathers from (hpZ).
_ZERO3 = dict(precision="fp16", reduce_precision="fp16", prefetch=1, gathers_per_unit=6, **FULL)
_ZEROPP = dict(_ZERO3, layout="hybrid_secondary", shard_group_size=16, wire="params=int8,grads=int4")
_ZERO3_AT_400 = ("ZeRO-3 over four of a DGX-2's eight NICs is predicted 18-31% faster than measured: the runs reached "
                 "1.5-1.8x their throughput over one NIC where the model gives 1.8-2.5x; not yet understood")


# InternLM's ZeRO-1 ("hybrid zero", zero1=8: optimizer states sharded within each node, parameters
# replicated) all-reduces the bf16 gradients of the last micro-batch over every data-parallel rank, in
# buckets of 512M elements, behind backward (InternLM/InternLM at fa7337b, hybrid_zero_optim.py,
# configs/7B_sft.py): the simulator's ``zero1`` layout, one flat all-reduce over the world per bucket.
_INTERNLM = dict(layout="zero1", shard_group_size=8, reduce_bucket_elements=512 * 2**20, reduce_precision="bf16")
_INTERNLM_SYNC = ("InternLM's 7B at 2 sequences per GPU and 1 or 2 micro-batches on 512-1024 A100s is predicted "
                  "17-20% faster than measured: at 1024 GPUs and one micro-batch it measured the same step with "
                  "and without recomputation (2341 and 2346 tokens/s), so its gradient all-reduce sets it; priced "
                  "as a flat ring over every GPU (1023 steps of 14 us per phase), it still runs faster than "
                  "measured; the device synchronize before each bucket is not modelled")


def _selective(hfu: float, mfu: float) -> dict:
    """Checkpointing that recomputes the part of the forward a run's hardware and model FLOP
    utilizations say it did: HFU counts the recomputed forward (a third of the step's model FLOPs
    for all of it), MFU does not."""
    return dict(activation_checkpointing=True, recompute_fraction=round(3 * (hfu / mfu - 1), 2))

PUBLISHED = [
    # torchtitan, docs/performance.md (mid-2024): FSDP2 on 64 A100 80GB, one unit gathered ahead.
    Point("torchtitan-a100", "llama3.1-8b", "a100-80gb-rdma-1600", 64, dict(micro_batch=1, prefetch=1, **SELECTIVE),
          2973),
    Point("torchtitan-a100", "llama2-13b", "a100-80gb-rdma-1600", 64, dict(micro_batch=2, prefetch=1), 2162),
    Point("torchtitan-a100", "llama2-70b", "a100-80gb-rdma-1600", 64, dict(micro_batch=2, prefetch=1, **FULL), 353),
    Point("torchtitan-a100", "llama3-70b", "a100-80gb-rdma-1600", 64, dict(micro_batch=1, prefetch=1, **FULL), 331),
    # IBM and PyTorch, fms-fsdp's README (2024): 128 A100 80GB at 400 Gbps, bf16 reductions.
    Point("fms-fsdp", "llama2-7b", "ibm-a100-roce", 128, dict(micro_batch=2, layout="hybrid", reduce_precision="bf16"),
          3760),
    Point("fms-fsdp", "llama2-13b", "ibm-a100-roce", 128, dict(micro_batch=1, layout="hybrid", reduce_precision="bf16"),
          1700),
    Point("fms-fsdp", "llama2-34b", "ibm-a100-roce", 128, dict(micro_batch=8, reduce_precision="bf16", **FULL), 772),
    Point("fms-fsdp", "llama2-70b", "ibm-a100-roce", 128, dict(micro_batch=6, reduce_precision="bf16", **FULL), 380),
    # The same README's later tables: every model at 2 sequences per GPU, on those 128 A100s and on 96
    # H100s at 800 Gbps, eager (its March 2024 version, 4ffb9bd) and compiled (May 2024, ed74fd5).
    # fms-fsdp's "selective" checkpointing recomputes whole blocks, every k-th: the fraction of the
    # forward it recomputes is 3 (HFU / MFU - 1) from the same README's MFU and HFU (PyTorch's FLOP
    # counter, recomputation included) for that run; 34B and 70B recompute every block (eager: "Full AC").
    *(Point("fms-fsdp" + (" compiled" if compiled else ""), f"llama2-{size}", cluster, gpus,
            dict(micro_batch=2, reduce_precision="bf16", compile=compiled, **checkpointing), measured)
      for compiled, size, checkpointing, a100, h100 in (
          (False, "7b", dict(layout="hybrid"), 3700, 7500),
          (False, "13b", {}, 1800, 3800),  # selective: a fraction per GPU, below
          (False, "34b", FULL, 700, 1550),
          (False, "70b", FULL, 370, 800),
          (True, "7b", dict(layout="hybrid"), 4550, 9600),
          (True, "13b", {}, 2150, 4850),
          (True, "34b", FULL, 820, 1830),
          (True, "70b", FULL, 410, 890))
      for cluster, gpus, measured in (("ibm-a100-roce", 128, a100), ("ibm-h100-rdma-800", 96, h100))
      if size != "13b" and (compiled, size, cluster) != (False, "7b", "ibm-a100-roce")),  # that one is above
    # 13B's selective checkpointing: HFU / MFU 0.59 / 0.51 and 0.40 / 0.35 eager, 0.69 / 0.61 and 0.46 / 0.43
    # compiled (A100, H100).
    Point("fms-fsdp", "llama2-13b", "ibm-a100-roce", 128,
          dict(micro_batch=2, reduce_precision="bf16", **_selective(0.59, 0.51)), 1800),
    Point("fms-fsdp", "llama2-13b", "ibm-h100-rdma-800", 96,
          dict(micro_batch=2, reduce_precision="bf16", **_selective(0.40, 0.35)), 3800),
    Point("fms-fsdp compiled", "llama2-13b", "ibm-a100-roce", 128,
          dict(micro_batch=2, reduce_precision="bf16", compile=True, **_selective(0.69, 0.61)), 2150),
    Point("fms-fsdp compiled", "llama2-13b", "ibm-h100-rdma-800", 96,
          dict(micro_batch=2, reduce_precision="bf16", compile=True, **_selective(0.46, 0.43)), 4850),
    # MosaicML, LLM Foundry's throughput tables (2023): MPT models at 2048 tokens.
    Point("llm-foundry", "mpt-125m", "a100-80gb-rdma-1600", 8, dict(micro_batch=40, grad_accum=2, **COMPOSER), 142830),
    Point("llm-foundry", "mpt-1b", "a100-80gb-rdma-1600", 8, dict(micro_batch=14, grad_accum=4, **COMPOSER), 20513),
    Point("llm-foundry", "mpt-7b", "a100-80gb-rdma-1600", 8, dict(micro_batch=6, grad_accum=2, **COMPOSER), 4641),
    Point("llm-foundry", "mpt-30b", "a100-80gb-rdma-1600", 8,
          dict(micro_batch=3, grad_accum=21, **COMPOSER, **FULL), 916),
    Point("llm-foundry", "mpt-13b", "a100-40gb-rdma-1600", 128, dict(micro_batch=16, reduce_precision="bf16", **FULL),
          1972),
    # The same tables' 70b (mpt-70b.yaml: FULL_SHARD, mixed precision PURE, so bf16 reductions, and
    # activation checkpointing) on 128 A100 40GB and 64 and 32 A100 80GB.
    *(Point("llm-foundry", "mpt-70b", cluster, gpus,
            dict(micro_batch=batch, grad_accum=accumulation, reduce_precision="bf16", **COMPOSER, **FULL), measured)
      for cluster, gpus, batch, accumulation, measured in (
          ("a100-40gb-rdma-1600", 128, 4, 1, 376), ("a100-80gb-rdma-1600", 64, 8, 4, 410),
          ("a100-80gb-rdma-1600", 32, 2, 16, 373))),
    Point("llm-foundry", "mpt-1b", "h100-rdma-3200", 8, dict(micro_batch=14), 45455),
    Point("llm-foundry", "mpt-7b", "h100-rdma-3200", 8, dict(micro_batch=6), 10643),
    # torchtitan, docs/performance.md (December 2024) and Liang et al. 2024: Grand Teton H100s.
    Point("torchtitan-h100", "llama3.1-8b", "h100-grand-teton", 8, TRAININGS["torchtitan-llama3.1-8b"], 5762, 82.4),
    Point("torchtitan-h100", "llama3.1-8b", "h100-grand-teton", 128, TRAININGS["torchtitan-llama3.1-8b"], 5605, 67.0),
    Point("torchtitan-h100", "llama3.1-8b", "h100-grand-teton", 8, TRAININGS["torchtitan-llama3.1-8b-compile"], 6667,
          77.0),
    Point("torchtitan-h100", "llama3.1-8b", "h100-grand-teton", 128, TRAININGS["torchtitan-llama3.1-8b-compile"],
          6514, 62.0),
    Point("torchtitan-h100", "llama3.1-8b", "h100-grand-teton", 8, TRAININGS["torchtitan-llama3.1-8b-float8"], 8532,
          76.8),
    Point("torchtitan-h100", "llama3.1-8b", "h100-grand-teton", 128, TRAININGS["torchtitan-llama3.1-8b-float8"],
          8380, 61.8),
    # aws-samples/awsome-distributed-training, torchtitan on 4 AWS p5.48xlarge (March 2025): torchtitan's
    # llama3_8b.toml of then (1 sequence per GPU, selective "op" checkpointing), eager bf16, then with
    # compile = true and [float8] enable_float8_linear = true. torchtitan had replaced that key with
    # model.converters on 2025-02-15 (pytorch/torchtitan#823) and merged unknown toml keys without a word,
    # so the second run trained compiled in bf16: its gain over eager (1.159) is compile's alone on Grand
    # Teton (6,667 / 5,762 = 1.157).
    Point("awsome-torchtitan", "llama3.1-8b", "h100-efa-3200", 32,
          dict(_TORCHTITAN_LLAMA3, micro_batch=1), 6785),
    Point("awsome-torchtitan compiled", "llama3.1-8b", "h100-efa-3200", 32,
          dict(_TORCHTITAN_LLAMA3, micro_batch=1, compile=True), 7865),
    # AWS Machine Learning Blog, "Efficient Pre-training of Llama 3-like model architectures using torchtitan
    # on Amazon SageMaker" (with Meta, late 2024; configuration in aws-samples/sagemaker-distributed-training-
    # workshop, 14_torchtitan): the same 4 p5.48xlarge recipe, eager, compiled, compiled with float8 linear
    # layers, and with their weights gathered in fp8 too.
    *(Point(f"sagemaker-torchtitan {name}", "llama3.1-8b", "h100-efa-3200", 32,
            dict(_TORCHTITAN_LLAMA3, micro_batch=1, **options), measured)
      for name, options, measured in (
          ("eager", {}, 6475), ("compiled", dict(compile=True), 7166),
          ("float8", dict(compile=True, precision="fp8"), 8624),
          ("float8 gathers", dict(compile=True, precision="fp8", fp8_all_gather=True), 8950))),
    # torchtitan's benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md: 32 and 64 H200, float8 with
    # fp8 gathers, compiled, 2 sequences per GPU, at 47.96 and 46.97 GiB. Its configuration reads the op
    # policy, but that memory is what the memory model gives when backward recomputes every linear
    # layer (46 and 44 GiB), not the op policy as it runs in bf16 (71 and 69): by its memory, the policy
    # kept none of the float8 multiplies' outputs in this run (torch 2.8, torchao's float8 of June 2025).
    *(Point("torchtitan-h200", "llama3.1-8b", "h200-rdma-3200", gpus,
            dict(_TORCHTITAN_FLOAT8, **_LINEARS_RECOMPUTED), measured, memory_gib)
      for gpus, measured, memory_gib in ((32, 10938, 47.96), (64, 10753, 46.97))),
    # DeepSpeed's ZeRO++ blog (2023; its figures 6-8, the bars' TFLOP/s per GPU): the GPT 18B of its
    # tutorial on 384 V100s (24 DGX-2) over 1, 2, 4 and 8 InfiniBand NICs of 100 Gb/s, "1K" and "2K
    # tokens" per GPU (2 and 4 sequences of 512), ZeRO-3 against ZeRO++.
    *(Point(f"zero++ blog {'zero++' if plus else 'zero-3'} {nics * 100}G", "gpt-18b", "v100-dgx2-ib-800", 384,
            dict(_ZEROPP if plus else _ZERO3, micro_batch=sequences), _megatron_tokens_per_s(tflops, "gpt-18b"),
            inter_node=None if nics == 8 else rdma_link(nics * 100, V100_SMS, nics=nics),  # 8: the preset's
            miss=_ZERO3_AT_400 if (not plus and nics == 4) else None)
      for plus, nics, sequences, tflops in (
          (False, 1, 2, 14), (False, 1, 4, 26), (False, 4, 2, 25), (False, 4, 4, 40), (False, 2, 4, 37),
          (False, 8, 4, 47), (True, 1, 2, 31), (True, 1, 4, 46), (True, 4, 2, 35), (True, 4, 4, 53),
          (True, 2, 4, 50), (True, 8, 4, 54))),
    # InternLM's performance tables (InternLM/InternLM, doc/en/train_performance.md, "FLOPS Testing",
    # July 2023): its 7B on 8 to 1024 A100-SXM4-80GB, 4 x 100 Gb RoCE per node, sequences of 2048
    # packed, bf16, zero1=8; micro-batch and micro-batches as the rows state them, with and without
    # activation checkpointing (whole blocks): both tables whole, 22 runs. The runs at 1024 GPUs and a
    # 4M-token batch have 2 sequences per GPU.
    *(Point(f"internlm {'ckpt' if checkpointing else 'no-ckpt'} x{accumulation}", "internlm-7b",
            "a100-80gb-roce-400", gpus,
            dict(_INTERNLM, micro_batch=batch, grad_accum=accumulation, activation_checkpointing=checkpointing),
            measured, miss=_INTERNLM_SYNC if (not checkpointing and accumulation < 4 and gpus >= 512) else None)
      for checkpointing, gpus, batch, accumulation, measured in (
          *((True, gpus, 8, 1, measured) for gpus, measured in (
              (8, 3314), (16, 3268), (32, 3323), (64, 3217), (128, 3260), (256, 3215), (512, 3199), (1024, 3163))),
          (True, 512, 4, 1, 2963), (True, 1024, 2, 1, 2341), (True, 1024, 4, 1, 2796),
          *((False, gpus, 2, 4, measured) for gpus, measured in (
              (8, 4103), (16, 3939), (32, 3919), (64, 3944), (128, 3928), (256, 3920), (512, 3900), (1024, 3625))),
          (False, 512, 2, 2, 3084), (False, 1024, 2, 1, 2346), (False, 1024, 2, 2, 2817))),
]


# ---- SageMaker's SMDDP study: one job on AWS p4d with NCCL and with SMDDP -----------------------
# "Enable faster training with Amazon SageMaker data parallel library" (AWS Machine Learning Blog, December 2023),
# as quoted to the project (the study is not among ../shared/seeds/, whose three documents are IBM's FSDP scaling,
# NCCL and EFA on P3dn, and ZeRO-3 on p4d): Llama 2 13B with FSDP's full sharding on 64 p4d.24xlarge (512 A100
# 40GB, 4 x 100 Gbps of EFA per node), a global batch of 4M tokens (1024 sequences of 4096: 2 per GPU), 97.89
# model TFLOP/s per GPU with NCCL and 121.85 with SMDDP's all-gather. Its text says why they differ: NCCL's
# all-gather reaches about 80% of the link only at large buffers and holds up to 24 of 108 SMs, SMDDP's 90% at
# small buffers with 9 SMs (``CLUSTERS["a100-efa-400"]`` and ``COLLECTIVES["smddp"]``). Assumed: activation
# checkpointing (2 x 4096 tokens of Llama 2 13B do not fit in 40 GB without it), fp32 reductions (the default).
_SMDDP_NCCL_MISS = ("NCCL on 64 p4d is predicted 19% faster than measured (116 against 97.89 TFLOP/s): the "
                    "study's 'about 80% only at large buffers' is priced at its peak, with NCCL's 14 us per ring "
                    "step; how far below it NCCL runs at this job's 1.2 MB per rank and step is not stated")


def _model_tokens_per_s(tflops: float, model: str) -> float:
    """Tokens per second per GPU from model TFLOP/s as the simulator counts them (3 x forward)."""
    return tflops * 1e12 / (architecture(MODELS[model], 2).model_flops / MODELS[model].seq_len)


@dataclasses.dataclass(frozen=True)
class LibraryPoint(Point):
    """A published run on a cluster preset running the collective library ``collectives``."""

    collectives: str = "nccl"

    def predict(self):
        cluster = dataclasses.replace(CLUSTERS[self.cluster], collectives=self.collectives)
        cluster = parse("cluster", {**as_dict(cluster), "nodes": self.gpus // cluster.gpus_per_node})
        return predict(MODELS[self.model], cluster, TrainingSpec(**self.training))


PUBLISHED += [
    LibraryPoint(f"smddp-study {library}", "llama2-13b", "a100-efa-400", 512, dict(micro_batch=2, **FULL),
                 _model_tokens_per_s(tflops, "llama2-13b"), miss=miss, collectives=library)
    for library, tflops, miss in (("nccl", 97.89, _SMDDP_NCCL_MISS), ("smddp", 121.85, None))
]
# ---- end of the SMDDP study -------------------------------------------------------------------------------------


def _label(point: Point) -> str:
    training = point.training.name if isinstance(point.training, TrainingSpec) else f"b{point.training['micro_batch']}"
    return f"{point.source}:{point.model}:{point.gpus}x{point.cluster}:{training}"


@pytest.fixture(scope="module")
def errors() -> dict[str, float]:
    labels = [_label(p) for p in PUBLISHED]
    assert len(set(labels)) == len(labels), "two points of one label would check one of them"
    return {_label(p): p.predicted_tokens_per_s() / p.tokens_per_s - 1 for p in PUBLISHED}


@pytest.mark.parametrize("point", [pytest.param(p, marks=pytest.mark.xfail(reason=p.miss, strict=True)) if p.miss
                                   else p for p in PUBLISHED], ids=_label)
def test_published_throughput_is_predicted(point, errors):
    assert abs(errors[_label(point)]) <= TOLERANCE


def test_most_published_points_are_predicted_within_ten_percent(errors):
    assert len(PUBLISHED) >= 8
    assert sum(abs(e) <= MOST for e in errors.values()) >= 0.75 * len(errors)


def test_the_network_sets_a_part_of_the_step_in_at_least_a_dozen_published_runs():
    """The runs that check the network's part: each node's NICs busy for a third of the step or more."""
    busy = [p for p in PUBLISHED if (q := p.predict()).timeline.link_busy_s["inter"] >= q.step_time_s / 3]
    assert len(busy) >= 12


@pytest.mark.parametrize("point", [p for p in PUBLISHED if p.memory_gib], ids=_label)
def test_published_peak_memory_is_predicted(point):
    assert point.predict().memory.total / GIB == pytest.approx(point.memory_gib, rel=TOLERANCE)


NODES = [1, 2, 4, 8, 16, 32, 64]
RUNS = {
    "3b": ("t5-3b", "ibm-t5-3b"),
    "11b block, batch 20": ("t5-11b", "ibm-t5-11b-batch20-block"),
    "11b block, batch 50": ("t5-11b", "ibm-t5-11b-batch50-block"),
    "11b sliding, batch 50": ("t5-11b", "ibm-t5-11b-batch50-sliding"),
}


@pytest.fixture(scope="module")
def efficiency() -> dict[str, dict[int, float]]:
    cluster = CLUSTERS["ibm-a100-ethernet"]
    result = {}
    for run, (model, training) in RUNS.items():
        s = sweep(MODELS[model], cluster, TRAININGS[training], "nodes", NODES)
        assert all(p.memory.fits for p in s.points), f"{run} must fit in 80 GB, as it did"
        result[run] = dict(zip(NODES, s.scaling_efficiency, strict=True))
    return result


def test_t5_3b_scales_at_about_95_percent_to_64_nodes(efficiency):
    assert efficiency["3b"][64] == pytest.approx(0.95, abs=0.10)


def test_t5_11b_with_the_sliding_window_reaches_90_percent_at_32_nodes_and_80_at_64(efficiency):
    assert efficiency["11b sliding, batch 50"][32] == pytest.approx(0.90, abs=0.10)
    assert efficiency["11b sliding, batch 50"][64] == pytest.approx(0.80, abs=0.10)


@pytest.mark.parametrize("nodes", [32, 64])
def test_t5_11b_runs_come_in_the_documents_order(efficiency, nodes):
    """Block-and-flush at batch 20 clearly worst; the larger batch in between; the sliding window best."""
    small_block = efficiency["11b block, batch 20"][nodes]
    large_block = efficiency["11b block, batch 50"][nodes]
    sliding = efficiency["11b sliding, batch 50"][nodes]
    assert small_block < 0.6
    assert small_block + 0.1 < large_block < sliding - 0.1


def test_efficiency_falls_with_scale(efficiency):
    for run, by_nodes in efficiency.items():
        values = [by_nodes[n] for n in NODES]
        assert values[0] == pytest.approx(1.0)
        assert all(a >= b for a, b in zip(values, values[1:], strict=False)), run
