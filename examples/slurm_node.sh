#!/bin/bash
# One node's part of a Slurm job (started by srun, one task per node, from slurm_one_world.sh or
# slurm_separate_jobs.sh): finds this node's rank from its position in NODELIST (static rendezvous, not
# arrival order) and starts its GPU ranks through the launcher on an unmodified pretrain_gpt.py.
# Needs NODELIST, GPUS_PER_NODE, MASTER_ADDR, MASTER_PORT and MEGATRON in the environment.
set -euo pipefail
read -r -a nodes <<< "$NODELIST"
for i in "${!nodes[@]}"; do [[ ${nodes[$i]} == "$SLURMD_NODENAME" ]] && NODE_RANK=$i; done
exec torchrun --nnodes "${#nodes[@]}" --nproc-per-node "$GPUS_PER_NODE" --node-rank "${NODE_RANK:?not in the node list}" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    -m megatron_diloco.launch "$MEGATRON/pretrain_gpt.py" "$@"
