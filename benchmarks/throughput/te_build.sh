#!/bin/bash
# Builds transformer_engine_torch 2.20.2 (the sdist, unpacked in /tmp/te/src) against this machine's torch,
# into /tmp/te/dist/*.whl; touches /tmp/te/build.done at the end (BUILD_OK / BUILD_FAILED in the log).
# Started in the background by te_device.sh start (setsid), from a copy in /tmp/te.
set -x
SITE=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
inc() { local f; f=$(find "$SITE/nvidia" /usr/local/cuda/include /usr/local/cuda/targets /usr/include -name "$1" 2>/dev/null | head -1); [ -n "$f" ] && dirname "$f"; }
export CPLUS_INCLUDE_PATH=$(inc cudnn.h):$(inc nccl.h)
export CUDA_HOME=/usr/local/cuda NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS=90 TORCH_CUDA_ARCH_LIST=9.0 \
       NVTE_WITH_NCCL_EP=0 MAX_JOBS=16 NVTE_BUILD_MAX_JOBS=16 NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_NO_LOCAL_VERSION=1
cd /tmp/te/src/transformer_engine_torch-2.20.2 || exit 1
python3 -c "import wheel.bdist_wheel" 2>/dev/null || \
    sed -i 's/from wheel.bdist_wheel import bdist_wheel/from setuptools.command.bdist_wheel import bdist_wheel/' setup.py
t0=$(date +%s)
if python3 -m pip wheel --no-deps --no-build-isolation -v -w /tmp/te/dist . ; then echo BUILD_OK; else echo BUILD_FAILED; fi
echo "build took $(( $(date +%s) - t0 )) s"
touch /tmp/te/build.done
