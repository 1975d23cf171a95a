#!/bin/bash
# A/B of the library at an earlier commit against the working tree's, alternating the two so that
# both see the same load on a shared machine. Both run the working tree's benchmarks, each with its
# own src/ first on PYTHONPATH (the workers torchrun starts inherit it):
#   bash benchmarks/ab_commits.sh BASE_COMMIT OUT_DIR [ROUNDS COMMAND...]
# With COMMAND, runs it ROUNDS times with each library (the working tree's first in each round),
# `{out}` in it replaced by OUT_DIR/{new,old}_ROUND, its output in OUT_DIR/{new,old}_ROUND.log.
# Without, the default: compare_{old,new}_{1,2}.{json,log}
# (benchmarks/compare_systems.py, shardwire only, worlds 2 and 4) and bench_{old,new}_{1,2}.{json,log}
# (shardwire bench --impl shardwire) into OUT_DIR.
set -euo pipefail
base=$1
out=$(realpath -m "$2")
here=$(cd "$(dirname "$0")/.." && pwd)
old=$(mktemp -d)
git -C "$here" worktree add -q --detach "$old" "$base"
trap 'git -C "$here" worktree remove --force "$old"' EXIT
mkdir -p "$out"
if [ $# -gt 2 ]; then
  rounds=$3
  shift 3
  for i in $(seq 1 "$rounds"); do
    for v in new old; do
      dir=$here; [ $v = old ] && dir=$old
      (cd "$here" && PYTHONPATH="$dir/src" "${@//\{out\}/$out/${v}_$i}") > "$out/${v}_$i.log" 2>&1
    done
  done
  exit 0
fi
for i in 1 2; do
  for v in old new; do
    dir=$here; [ $v = old ] && dir=$old
    (cd "$here" && PYTHONPATH="$dir/src" python benchmarks/compare_systems.py --systems shardwire --worlds 2 4 \
        --model 30m --batch 2 --steps 10 --repeats 1 --json "$out/compare_${v}_$i.json") > "$out/compare_${v}_$i.log" 2>&1
  done
done
for i in 1 2; do
  for v in old new; do
    dir=$here; [ $v = old ] && dir=$old
    (cd "$out" && PYTHONPATH="$dir/src" python -m shardwire bench --nproc 2 --impl shardwire --ops all_gather \
        reduce_scatter -b 64K -e 64M -f 4 --check --json "$out/bench_${v}_$i.json") > "$out/bench_${v}_$i.log" 2>&1
  done
done
