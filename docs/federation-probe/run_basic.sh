#!/bin/bash
# Probe 1: lighthouse + R replicas x W ranks, N rounds; quorum cost per round.
# usage: run_basic.sh R W ROUNDS COMPUTE_S LOG
cd "$(dirname "$0")"
R=${1:-2}; W=${2:-1}; N=${3:-10}; C=${4:-0.2}; LOG=${5:-logs/basic.jsonl}
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill -9 -- -$p 2>/dev/null; done; }
trap cleanup EXIT
rm -f $LOG
setsid timeout 300 venv/bin/torchft_lighthouse --min_replicas 1 --bind 127.0.0.1:29610 --join_timeout_ms 1000 > logs/lighthouse_basic.txt 2>&1 &
PIDS+=($!)
sleep 0.5
for i in $(seq 0 $((R-1))); do
  name=$(echo ABCDEFGH | cut -c$((i+1)))
  for k in $(seq 0 $((W-1))); do
    setsid timeout 240 venv/bin/python fed_worker.py --lighthouse http://127.0.0.1:29610 --replica $name --rank $k --world $W \
      --store-port $((29620+i)) --rounds $N --compute-s $C --log $LOG "${@:6}" > logs/w_${name}${k}.txt 2>&1 &
    PIDS+=($!)
  done
done
for p in "${PIDS[@]:1}"; do wait $p; done
