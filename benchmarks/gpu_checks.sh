#!/usr/bin/env bash
# The checks that need a GPU, in one run from the repository root of a GPU machine that has torch:
# the CUDA/NCCL suite, the host's step as one rank of 8 to 64 (benchmarks/large_world.py), then
# shardwire train's step eager against compiled units, on one GPU.
#
#   bash benchmarks/gpu_checks.sh [OUT_DIR]      # logs and results into OUT_DIR (default: gpu-checks)
#
# The train runs are one rank (torchrun, NCCL); tokens/s is read from their last progress line, an
# interval that starts after the first step, so compiling stays out of it.
set -uo pipefail
out=${1:-gpu-checks}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))" | tee "$out/device.txt"
timeout 480 python3 -m pytest tests/gpu -q -p no:cacheprovider -x 2>&1 | tee "$out/tests_gpu.log"
timeout 240 python3 benchmarks/large_world.py --devices cuda --json "$out/large_world.json" 2>&1 \
    | tee "$out/large_world.txt"
for compiled in --no-compile --compile; do
  timeout 240 python3 -m shardwire train --backend nccl --nproc 1 --model gpt-125m --precision bf16 --batch 8 \
      --steps 30 --log-every 10 --eval-batches 1 "$compiled" 2>&1 | tee "$out/train$compiled.log" | grep -E "^step|^done|error"
done
