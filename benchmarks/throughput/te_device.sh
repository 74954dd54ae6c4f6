#!/bin/bash
# Transformer Engine, once, on a lent H200 (no registry there): TE 2.20.2 brought in pieces over consecutive
# calls of one lease, the torch extension built there in the background, then the example run with TE layers.
#
# Here (registry access), once: the wheels (transformer-engine-cu13 2.20.2, 276 MB; transformer-engine 2.20.2;
# pydantic 2.14.4 + pydantic-core, annotated-types, typing-inspection, typing-extensions, nvdlfw-inspect) and
# .whl/ (megatron-core, torchft, ...) tarred into one 287 MB blob, `split -n 5` into .te1/part.1 ... .te5/part.5
# (each folder in .git/info/exclude), with the sdist transformer_engine_torch-2.20.2.tar.gz in .te1 and the
# blob's sha256 in .te5. On the device, back to back (the machine goes back 30 s after a call ends):
#   run(command="bash benchmarks/throughput/te_device.sh start",   carry=[".te1"])  # starts the build
#   run(command="bash benchmarks/throughput/te_device.sh chunk 2", carry=[".te2"])  # ... 3, 4
#   run(command="bash benchmarks/throughput/te_device.sh install && bash benchmarks/throughput/te_device.sh runs",
#       carry=[".te5"])
# Everything lives in /tmp/te on the device's own disk (a carried folder not named again is removed from the
# repo copy there). Logs worth keeping go to $OUT.
set -o pipefail
cd "$(dirname "$0")/../.."
T=/tmp/te
OUT=${OUT:-$T/out}
mkdir -p $T $OUT
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD CUDA_DEVICE_MAX_CONNECTIONS=1 NCCL_NVLS_ENABLE=0 \
       TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

status() {
    echo "--- build: $(find $T/src -name '*.o' 2>/dev/null | wc -l) objects, done: $([ -e $T/build.done ] && echo yes || echo no)"
    grep -E "^\[[0-9]+/[0-9]+\]|BUILD_|build took|error|Error" $T/build.log 2>/dev/null | tail -4
    tail -2 $T/build.log 2>/dev/null | cut -c1-300
    ls -la $T/part.* 2>/dev/null | awk '{print $5, $9}'
}

case "$1" in
start)
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    echo "cores $(nproc)"; df -h /tmp | tail -1
    python3 -c "import torch, sys; print(sys.executable, 'torch', torch.__version__, 'cuda', torch.version.cuda, 'cxx11abi', torch._C._GLIBCXX_USE_CXX11_ABI)"
    nvcc --version | tail -1; gcc --version | head -1; ninja --version
    SITE=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    find $SITE/nvidia /usr/local/cuda/include /usr/include -name cudnn.h -o -name nccl.h -o -name cudnn_version.h 2>/dev/null
    python3 -m pip list 2>/dev/null | grep -i -E "^(pydantic|typing.ext|wheel|setuptools|pybind11|einops|onnx|packaging|transformer|megatron) "
    cp .te1/part.1 $T/ && rm -rf $T/src $T/dist $T/build.done && mkdir -p $T/src \
        && tar xzf .te1/transformer_engine_torch-2.20.2.tar.gz -C $T/src || exit 1
    cp benchmarks/throughput/te_build.sh $T/
    (cd $T && setsid nohup bash $T/te_build.sh > $T/build.log 2>&1 < /dev/null &)
    sleep 25
    status
    ;;
chunk)
    cp .te$2/part.$2 $T/ && status
    ;;
install)
    cp .te5/part.5 $T/ || exit 1
    cat $T/part.1 $T/part.2 $T/part.3 $T/part.4 $T/part.5 > $T/blob.tar
    (cd $T && sha256sum blob.tar) | tee -a $OUT/install.log
    [ "$(cut -d' ' -f1 .te5/blob.sha256)" = "$(sha256sum $T/blob.tar | cut -d' ' -f1)" ] || { echo "BLOB SHA MISMATCH"; exit 1; }
    rm -f $T/part.*; tar xf $T/blob.tar -C $T && rm $T/blob.tar
    t0=$(date +%s)
    python3 -m pip install --no-deps -q $T/pkgs/whl/*.whl $T/pkgs/whl/opt/*.whl $T/pkgs/extra/*.whl 2>&1 | tail -3
    python3 -m pip install --no-deps -q $T/pkgs/transformer_engine_cu13-*.whl $T/pkgs/transformer_engine-2.20.2-*.whl 2>&1 | tail -3
    echo "pip installs: $(( $(date +%s) - t0 )) s" | tee -a $OUT/install.log
    for i in $(seq 1 ${WAIT_BUILD:-60}); do [ -e $T/build.done ] && break; sleep 5; [ $((i % 6)) = 0 ] && status; done
    status | tee -a $OUT/install.log
    cp $T/build.log $OUT/build.log
    grep -q BUILD_OK $T/build.log || { echo "BUILD NOT OK"; exit 1; }
    ls -la $T/dist | tee -a $OUT/install.log
    python3 -m pip install --no-deps -q $T/dist/transformer_engine_torch-*.whl 2>&1 | tail -3
    python3 -m pip list 2>/dev/null | grep -i -E "^(transformer|pydantic|megatron|torch |torchft)" | tee -a $OUT/install.log
    python3 benchmarks/throughput/te_check.py 2>&1 | tee -a $OUT/install.log
    ;;
runs)
    rm -rf $T/runs
    python3 benchmarks/throughput/te_once.py --out $T/runs --commit "${COMMIT:-unknown}" ${RUNS:+--runs $RUNS} 2>&1 \
        | tee $OUT/te_once.log
    cp $T/runs/te_once.json $OUT/ 2>/dev/null
    for d in $T/runs/*/; do n=$(basename $d); for f in $d/log.txt $d/replica0.log $d/replica1.log; do
        [ -e $f ] && cp $f $OUT/${n}_$(basename $f); done; done
    ls $OUT
    ;;
fast)  # the fast path's runs with TE layers beside the local fast path (benchmarks/throughput/fast_path.py)
    rm -rf $T/fast
    python3 benchmarks/throughput/fast_path.py --out $T/fast --commit "${COMMIT:-unknown}" --budget-s 420 \
        --runs "${FAST_RUNS:-85M:fast_rope:512,85M:te:512,302M:fast_rope:128,302M:te:128,85M:local:256}" 2>&1 \
        | tail -40 | tee $OUT/fast_path.log
    cp $T/fast/fast_path.json $OUT/ 2>/dev/null
    ;;
status) status ;;
esac
