#!/bin/bash
# DiLoCoX across two clusters as ONE torchrun world, under Slurm. A template: adapt the #SBATCH lines,
# the paths and the Megatron flags; it was checked for syntax only (bash -n), not run.
#
# Layout: N nodes, the first N/2 (in Slurm's node order) in cluster A, the rest in cluster B; one
# torchrun per node starting GPUS_PER_NODE ranks; rendezvous on the first node (cluster A).
# Replica r is the r-th contiguous block of world / R ranks, so node order decides which cluster holds
# which replica: the script checks it against SITE_A_REGEX instead of trusting it.
#
# The cross-cluster link carries only the outer groups (each rank with its peer in the other replica:
# the compressed pseudo-gradients, once per round) and one small all-reduce per round over the whole
# world (gloo), plus evaluation, checkpointing and start-up traffic. All of it is unencrypted and
# unauthenticated (NCCL, gloo, the TCP store): run it over a VPN or a private line.
#
#SBATCH --job-name=diloco-x
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=48:00:00

set -euo pipefail

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_PORT=${MASTER_PORT:-29500}           # the TCP store on the first node; NCCL / gloo use ephemeral ports
MEGATRON=${MEGATRON:-/opt/Megatron-LM}      # a checkout holding pretrain_gpt.py (core_v0.19.x)
SITE_A_REGEX=${SITE_A_REGEX:?set SITE_A_REGEX to a regex matching cluster A node names, e.g. ^a-gpu}

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
N=${#NODES[@]}
for i in "${!NODES[@]}"; do                 # first half cluster A, second half cluster B
    in_a=0; [[ ${NODES[$i]} =~ $SITE_A_REGEX ]] && in_a=1
    if (( (i < N / 2) != in_a )); then
        echo "node $i (${NODES[$i]}) is in the wrong half: cluster A's nodes must come first" >&2; exit 1
    fi
done
MASTER_ADDR=${NODES[0]}

# Networking. Inside a cluster NCCL uses its fast network as usual; the interface named here must also
# reach the other cluster (gloo, the store, NCCL's bootstrap and socket transport use it).
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-eth0}
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$NCCL_SOCKET_IFNAME}
# NCCL picks one network per process: if InfiniBand / RoCE does not route between the clusters, the
# cross-cluster groups need the socket transport, which moves intra-cluster NCCL traffic to TCP too:
# export NCCL_IB_DISABLE=1
export CUDA_DEVICE_MAX_CONNECTIONS=1        # as usual for Megatron

TRAIN_ARGS=(
    # --- your usual Megatron flags (model, data, schedule); placeholders here ---
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size 1
    --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 --max-position-embeddings 4096
    --micro-batch-size 1 --global-batch-size 512   # the sum over both replicas (256 each)
    --train-iters 100000 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000 --bf16
    --data-path /data/corpus_text_document --tokenizer-type HuggingFaceTokenizer --tokenizer-model /data/tokenizer
    # torch_dist checkpoints: both replicas write, so every node of both clusters must see this path
    --save /shared/ckpt --load /shared/ckpt --save-interval 2000
    --tensorboard-dir /shared/tb
    # --- DiLoCoX: size H and the link with python -m megatron_diloco.plan ---
    --diloco-x --diloco-x-replicas 2 --diloco-x-local-steps 100
    --diloco-x-bandwidth-mbps 956              # the line between the clusters (the plan prints this value)
)

export N GPUS_PER_NODE MASTER_ADDR MASTER_PORT MEGATRON NODELIST="${NODES[*]}"
# One task per node (examples/slurm_node.sh: its node rank from NODELIST, then torchrun on its GPUs);
# sbatch runs a copy of this script, so the examples are found from the submit directory.
EXAMPLES=${EXAMPLES:-$SLURM_SUBMIT_DIR/examples}
srun --kill-on-bad-exit=1 --ntasks-per-node=1 "$EXAMPLES/slurm_node.sh" "${TRAIN_ARGS[@]}"
