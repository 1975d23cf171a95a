#!/bin/bash
# A/B of shardwire's own step and collectives between an earlier commit and the working tree,
# alternating the two so that both see the same load on a shared machine:
#   bash benchmarks/ab_commits.sh BASE_COMMIT OUT_DIR
# writes compare_{old,new}_{1,2}.{json,log} (benchmarks/compare_systems.py, shardwire only, worlds
# 2 and 4) and bench_{old,new}_{1,2}.{json,log} (shardwire bench --impl shardwire) into OUT_DIR.
set -euo pipefail
base=$1
out=$(realpath -m "$2")
here=$(cd "$(dirname "$0")/.." && pwd)
old=$(mktemp -d)
git -C "$here" worktree add -q --detach "$old" "$base"
trap 'git -C "$here" worktree remove --force "$old"' EXIT
mkdir -p "$out"
for i in 1 2; do
  for v in old new; do
    dir=$here; [ $v = old ] && dir=$old
    (cd "$dir" && PYTHONPATH="$dir/src" python benchmarks/compare_systems.py --systems shardwire --worlds 2 4 \
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
