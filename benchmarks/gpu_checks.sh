#!/usr/bin/env bash
# The checks that need a GPU, in one run from the repository root of a GPU machine that has torch,
# most important first, each under its own time limit and all within GPU_CHECKS_SECONDS (default
# 480): a part that would start with under 20 s left is skipped, and says so.
#   1. the CUDA/NCCL suite (tests/gpu), on four workers where pytest-xdist is installed (the test
#      that times the GPU alone, after them);
#   2. the engine's overhead: the 1.3B and 350M GPTs on one GPU, each block compiled, shardwire
#      against the unsharded model, 3 rounds, with each run's kernel time by kind
#      (benchmarks/gpu_single.py --kernels);
#   3. a Llama-2-13B-shaped model built on the meta device as rank 0 of 64, its CUDA peak against the
#      memory model's (benchmarks/meta_13b.py);
#   4. fp8 against bf16 on a model of Llama 3 8B's widths, shardwire and the unsharded model
#      (benchmarks/gpu_fp8.py).
#
#   bash benchmarks/gpu_checks.sh [OUT_DIR]      # logs and results into OUT_DIR (default: gpu-checks)
#
# fp8 needs torchao; where the machine lacks it, put its wheel in .whl/ and this installs it for the run.
set -uo pipefail
out=${1:-gpu-checks}
deadline=$((SECONDS + ${GPU_CHECKS_SECONDS:-480}))
mkdir -p "$out"
if ls .whl/torchao-*.whl >/dev/null 2>&1 && ! python3 -c "import torchao" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/torchao-*.whl
  export PYTHONPATH="/tmp/site"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# part NAME LIMIT COMMAND...: run COMMAND under LIMIT seconds or the time left, whichever is less,
# its output into OUT_DIR/NAME.log; print its exit status and the log's last lines.
part() {
  local name=$1 limit=$2 left=$((deadline - SECONDS))
  shift 2
  (( left < limit )) && limit=$left
  if (( limit < 20 )); then echo "== $name: skipped, ${left} s left"; return; fi
  echo "== $name (limit ${limit} s)"
  timeout "$limit" "$@" 2>&1 | grep --line-buffered -v "Failed to load" > "$out/$name.log"
  echo "exit ${PIPESTATUS[0]} after $((SECONDS)) s"
  grep -v "^USDT" "$out/$name.log" | tail -n "${TAIL:-22}"
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0), 'NCCL', torch.cuda.nccl.version())"
} 2>&1 | tee "$out/device.txt"
# the one test that times the GPU runs alone, after the others, which share the GPU four at a time
timed_test=test_profiler_reports_a_known_reduce_scatter_delay
workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")
TAIL=14 part tests_gpu 150 bash -c "python3 -m pytest tests/gpu -q -p no:cacheprovider $workers --durations=5 \
    -k 'not $timed_test'; others=\$?; python3 -m pytest tests/gpu -q -p no:cacheprovider -k $timed_test \
    && exit \$others"
TAIL=40 part gpu_single 190 python3 benchmarks/gpu_single.py --sizes gpt-1.3b gpt-350m --systems unsharded shardwire \
    --variants compiled --rounds 3 --warmup 3 --steps 8 --kernels --json "$out/gpu_single.json"
TAIL=4 part meta_13b 70 python3 benchmarks/meta_13b.py --device cuda --world 64 --per-node 8 --seq-len 16 --steps 2 \
    --json "$out/meta_13b.json"
TAIL=12 part gpu_fp8 170 python3 benchmarks/gpu_fp8.py --layers 12 --seq-len 8192 --warmup 2 --steps 6 --kernels \
    --json "$out/gpu_fp8.json"
