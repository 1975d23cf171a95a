#!/usr/bin/env bash
# What the wire saves between fault-tolerant groups on a slow link: two groups, a node each of an
# emulated cluster at 100 Mbit/s (as root), train the same run with the sync (DiLoCo) or each
# step's gradients (fault-tolerant HSDP) exact and quantized; each run's wall time and each group's
# own "done:" line are kept.
#
#   bash benchmarks/ft_wire.sh benchmarks/results/ft-wire
#
# TESTBED names the testbed it builds and removes (default: shardwire).
#
# Every rank shares this machine's cores: the link, not the compute, is what differs between the
# runs of a pair.
set -euo pipefail
out=${1:?give the directory for the results}
steps=${STEPS:-100}
bed=${TESTBED:-shardwire}
mkdir -p "$out"
shardwire testbed up --name "$bed" --nodes 2 --link 100mbit
trap 'shardwire testbed down --name "$bed"' EXIT
shardwire testbed exec --name "$bed" node0 -- torchft_lighthouse --min_replicas 2 --join_timeout_ms 60000 \
  > /dev/null 2>&1 &
sleep 2

run() {  # NAME, then the options that differ
  local name=$1; shift
  local start=$SECONDS groups=()
  for k in 0 1; do
    shardwire testbed exec --name "$bed" node$k -- shardwire train --model small --steps "$steps" --log-every 20 \
      --layout hybrid --nproc 1 --fault-tolerance lighthouse="$bed-node0":29510 "$@" \
      > "$out/$name-node$k.log" 2>&1 &
    groups+=($!)
  done
  wait "${groups[@]}"
  echo "$name: $((SECONDS - start)) s wall; $(grep -h '^done:' "$out/$name"-node*.log | tr '\n' ' ')" \
    | tee -a "$out/summary.txt"
}

run diloco-fp32 --diloco sync_every=5,wire=none
run diloco-int4 --diloco sync_every=5,wire=int4
run hsdp-fp32 --wire none
run hsdp-int8 --wire grads=int8
