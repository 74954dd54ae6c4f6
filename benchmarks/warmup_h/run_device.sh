#!/bin/bash
# The warm-up across H on a GPU machine: run_device.sh "H:GPUS:METHODS:SEEDS" ...
# each spec one convergence.py invocation on CUDA_VISIBLE_DEVICES=GPUS, all at once; results under $OUT
# Install megatron-core with this script's own step (into the interpreter's site-packages), not with a
# --target folder of your own: the corpus is built from the text files under the interpreter's stdlib and
# site-packages (examples/stdlib_corpus.py), and its document count (7045 on the image of 2026-11-28)
# must match convergence_h.json's for the losses to be comparable.
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
[ -n "$SKIP_PIP" ] || $PY -m pip install --no-deps -q .whl/megatron_core-*.whl 2>&1 | tail -2
nvidia-smi --query-gpu=index,name,memory.total --format=csv 2>/dev/null
$PY -c "import torch, megatron.core; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"
$PY -c "import sys; sys.path.insert(0, 'examples'); import stdlib_corpus; print(stdlib_corpus.build_environment(${CORPUS_MB:-100}))"
i=0
rm -rf /tmp/runs30  # a warm machine keeps the last call's runs: convergence.py would merge them into this call's JSONs
mkdir -p /tmp/runs30
for spec in "$@"; do
  IFS=: read -r h gpus methods seeds <<< "$spec"
  i=$((i + 1))
  CUDA_VISIBLE_DEVICES=$gpus $PY benchmarks/convergence.py --out /tmp/runs30/r${i}_h$h --micro-batch 16 \
    --corpus-mb ${CORPUS_MB:-100} --eval-iters 32 --jobs-per-gpu 1 --parallel 4 --seeds $seeds --local-steps $h \
    --methods $methods $EXTRA > /tmp/runs30/r${i}_h$h.log 2>&1 &
done
wait
for d in /tmp/runs30/r*/; do d=${d%/}; cp $d/convergence.json $OUT/$(basename $d).json; done
tar czf $OUT/logs.tgz -C /tmp/runs30 .
grep -h "final \|end  " /tmp/runs30/r*.log
