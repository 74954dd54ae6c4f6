#!/bin/bash
# DiLoCoX with each cluster as its OWN Slurm job (separate schedulers, start times and failures), meeting
# the other jobs at every round boundary through torchft's lighthouse. A template: adapt the #SBATCH
# lines, the paths and the Megatron flags; it is checked for syntax only (bash -n), not run as is.
#
# Once, make the run's secret and copy it to every cluster over a channel you trust (scp, your vault):
#   head -c 32 /dev/urandom | base64 > run.secret && chmod 600 run.secret
# Once, where every cluster reaches it (a small always-on host), start the coordinator:
#   torchft_lighthouse --bind [::]:29510 --min_replicas 1 --join_timeout_ms 600000
# (--join_timeout_ms: longer than one round plus a heal; --min_replicas 2 makes the first job wait for
# the second instead of training alone.) Then, on each cluster:
#   cluster A:  REPLICA_INDEX=0 SITE=siteA LIGHTHOUSE=lh.example.org:29510 sbatch examples/slurm_separate_jobs.sh
#   cluster B:  REPLICA_INDEX=1 SITE=siteB LIGHTHOUSE=lh.example.org:29510 sbatch examples/slurm_separate_jobs.sh
# A job that dies is resubmitted the same way: it resumes from its own --save and joins at the next boundary.
#
# Reachable from the other clusters: the lighthouse; this job's first node on FEDERATION_PORT and
# TORCHFT_MANAGER_PORT; every rank's ephemeral gloo and heal ports. Handshakes and heals are authenticated
# with the secret; nothing crosses encrypted (docs/federation.md, threat model: a VPN for confidentiality).
# Inside the job NCCL uses the cluster's fast network as usual.
#
#SBATCH --job-name=diloco-x-site
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=48:00:00

set -euo pipefail

: "${REPLICA_INDEX:?the data slot of this cluster, 0..REPLICAS-1}" "${SITE:?a name for this cluster, e.g. siteA}"
: "${LIGHTHOUSE:?HOST:PORT of torchft_lighthouse}"
REPLICAS=${REPLICAS:-2}                     # the data slots of the run (the clusters you plan to have)
RUN=${RUN:-my-run}                          # the same on every cluster; another run's jobs are refused
SECRET=${SECRET:-$HOME/run.secret}          # the run's secret file, the same bytes on every cluster
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_PORT=${MASTER_PORT:-29500}           # this job's own torchrun rendezvous, inside the cluster
FEDERATION_PORT=${FEDERATION_PORT:-29520}   # the job's meeting point for the other jobs (rank 0)
export TORCHFT_MANAGER_PORT=${TORCHFT_MANAGER_PORT:-29521}
MEGATRON=${MEGATRON:-/opt/Megatron-LM}      # a checkout holding pretrain_gpt.py (core_v0.19.x)

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
MASTER_ADDR=${NODES[0]}
ADVERTISE=${ADVERTISE_HOST:-$MASTER_ADDR}   # the name or address the OTHER clusters reach this node by

export CUDA_DEVICE_MAX_CONNECTIONS=1        # as usual for Megatron
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-eth0}   # an interface that reaches the other clusters

TRAIN_ARGS=(
    # --- your usual Megatron flags (model, data, schedule); placeholders here ---
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size 1
    --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 --max-position-embeddings 4096
    --micro-batch-size 1 --global-batch-size 256   # per job (each cluster one replica)
    --train-iters 100000 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000 --bf16
    --data-path /data/corpus_text_document --tokenizer-type HuggingFaceTokenizer --tokenizer-model /data/tokenizer
    # each job saves and resumes its own checkpoints, on its own cluster's storage
    --save "/ckpt/$SITE" --load "/ckpt/$SITE" --save-interval 2000
    --tensorboard-dir "/tb/$SITE"
    # --- DiLoCoX: the same on every cluster but the slot, the id and the address ---
    --diloco-x --diloco-x-replicas "$REPLICAS" --diloco-x-local-steps 100
    --diloco-x-bandwidth-mbps 956              # this site's line to the others (python -m megatron_diloco.plan)
    --diloco-x-lighthouse "$LIGHTHOUSE" --diloco-x-run "$RUN" --diloco-x-secret-file "$SECRET"
    --diloco-x-replica-index "$REPLICA_INDEX" --diloco-x-replica-id "$SITE"
    --diloco-x-advertise-host "$ADVERTISE" --diloco-x-federation-port "$FEDERATION_PORT"
)

export GPUS_PER_NODE MASTER_ADDR MASTER_PORT MEGATRON NODELIST="${NODES[*]}"
# One task per node (examples/slurm_node.sh: its node rank from NODELIST, then torchrun on its GPUs);
# sbatch runs a copy of this script, so the examples are found from the submit directory.
EXAMPLES=${EXAMPLES:-$SLURM_SUBMIT_DIR/examples}
srun --kill-on-bad-exit=1 --ntasks-per-node=1 "$EXAMPLES/slurm_node.sh" "${TRAIN_ARGS[@]}"
