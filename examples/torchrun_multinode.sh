#!/bin/bash
# DiLoCoX on several nodes without a scheduler: run this on every node. A template (checked for syntax
# with bash -n, not run). One torchrun world; replica r is the r-th contiguous block of world / R ranks,
# so with two clusters give cluster A's nodes NODE_RANK 0..NNODES/2-1 and cluster B's the rest.
#
#   NNODES=4 NODE_RANK=0 MASTER_ADDR=a-node0 examples/torchrun_multinode.sh [more Megatron / DiLoCoX flags]
#
# Ports: MASTER_PORT on MASTER_ADDR (the TCP store); NCCL and gloo connect on ephemeral ports, so allow
# TCP between all nodes. What crosses between the clusters is unencrypted: use a VPN or a private line.

set -euo pipefail

: "${NNODES:?number of nodes}" "${NODE_RANK:?this node's rank, 0..NNODES-1}" "${MASTER_ADDR:?node 0's address}"
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MEGATRON=${MEGATRON:-/opt/Megatron-LM}      # a checkout holding pretrain_gpt.py (core_v0.19.x)

export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-eth0}           # reaches every node, both clusters
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$NCCL_SOCKET_IFNAME}
export CUDA_DEVICE_MAX_CONNECTIONS=1

exec torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    -m megatron_diloco.launch "$MEGATRON/pretrain_gpt.py" \
    --tensor-model-parallel-size 8 \
    --micro-batch-size 1 --global-batch-size 256 \
    --diloco-x --diloco-x-replicas 2 --diloco-x-local-steps 100 \
    "$@"   # your model, data and schedule flags (placeholders above: adapt)
