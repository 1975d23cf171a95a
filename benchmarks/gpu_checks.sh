#!/usr/bin/env bash
# The checks that need a GPU, in one run from the repository root of a GPU machine that has torch,
# most important first, each under its own time limit:
#   1. the CUDA/NCCL suite (tests/gpu);
#   2. the 1.3B GPT on one GPU, eager, compiled and fp8, against FSDP2 and the unsharded model
#      (benchmarks/gpu_single.py);
#   3. the host's step as one rank of 8 and 64 on the fake process group (benchmarks/large_world.py);
#   4. shardwire train on gpt-125m, compiled, in bf16 and in fp8: the validation loss of each;
#   5. a Llama-2-13B-shaped model built on the meta device as rank 0 of 64, its CUDA peak against the
#      memory model's (benchmarks/meta_13b.py).
# The limits add up to under the 10 minutes one command may hold a lent GPU machine.
#
#   bash benchmarks/gpu_checks.sh [OUT_DIR]      # logs and results into OUT_DIR (default: gpu-checks)
#
# fp8 needs torchao; where the machine lacks it, put its wheel in .whl/ and this installs it for the run.
set -uo pipefail
out=${1:-gpu-checks}
mkdir -p "$out"
if ls .whl/torchao-*.whl >/dev/null 2>&1 && ! python3 -c "import torchao" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/torchao-*.whl
  export PYTHONPATH="/tmp/site"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))" | tee "$out/device.txt"
timeout 200 python3 -m pytest tests/gpu -q -p no:cacheprovider --durations=8 2>&1 | tee "$out/tests_gpu.log" | tail -15
timeout 150 python3 benchmarks/gpu_single.py --sizes gpt-1.3b --variants eager compiled fp8 --rounds 1 --warmup 3 \
    --steps 8 --json "$out/gpu_single.json" 2>&1 | grep -v "Failed to load" | tee "$out/gpu_single.log" | tail -12
timeout 45 python3 benchmarks/large_world.py --devices cuda --worlds 8 64 --steps 10 --rounds 2 \
    --json "$out/large_world.json" 2>&1 | tee "$out/large_world.txt" | tail -8
for precision in bf16 fp8; do
  timeout 70 python3 -m shardwire train --backend nccl --nproc 1 --model gpt-125m --precision "$precision" --compile \
      --batch 8 --steps 300 --warmup 30 --lr 1e-3 --log-every 100 --eval-batches 8 2>&1 \
      | tee "$out/train-$precision.log" | grep -E "^shardwire|^step|^done|error"
done
timeout 60 python3 benchmarks/meta_13b.py --device cuda --world 64 --per-node 8 --seq-len 16 --steps 2 \
    --json "$out/meta_13b.json" 2>&1 | grep -v "Failed to load" | tee "$out/meta_13b.log" | tail -3
