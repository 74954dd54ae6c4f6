#!/bin/bash
# The fused RoPE (megatron_adapter/fused_rope.py) on one GPU, for RESULTS §9:
#  1. tests/test_fused_rope.py: its CPU checks, and on the GPU the compiled kernel against Megatron's
#     unfused RoPE (fp32 and bf16, at [512, 256, 12, 64] and with a partial rotary dim) and the speed of
#     forward + backward at that shape (printed: "RoPE [512, 256, 12, 64] bf16 ... fused ... ms");
#  2. fast_path.py: fast_workers against fast_rope (the same flags plus --rope-fusion), 85M at micro-batch
#     256 and 302M at 128, side by side.
# Writes $OUT/test_fused_rope.log, $OUT/fast_path.log and $OUT/fast_path.json. The device machine has no
# internet: megatron-core and the package's other wheels come from .whl/ (carry it), as the suite's runs do:
#     run(command="bash benchmarks/throughput/fused_rope_device.sh", carry=[".whl"], timeout_s=600)
# COMMIT=<sha> names the commit measured in fast_path.json (default: git's HEAD where there is one).
set -o pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
OUT=${OUT:-/tmp/fused_rope_out}
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
RUNS=/tmp/fused_rope_runs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p "$OUT"
[ -n "$SKIP_PIP" ] || $PY -m pip install --no-deps -q .whl/*.whl .whl/opt/*.whl 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, triton; from megatron.core import package_info as m; \
print('torch', torch.__version__, 'triton', triton.__version__, 'megatron-core', m.__version__)"
$PY -m pytest -q -s -p no:cacheprovider tests/test_fused_rope.py 2>&1 | tee "$OUT/test_fused_rope.log"
rm -rf $RUNS  # a warm machine keeps the last call's runs, which fast_path.py would skip as done
$PY benchmarks/throughput/fast_path.py --out $RUNS --commit "$COMMIT" \
    --runs 85M:fast_workers:256,85M:fast_rope:256,302M:fast_workers:128,302M:fast_rope:128 2>&1 \
    | tee "$OUT/fast_path.log"
cp $RUNS/fast_path.json "$OUT/"
