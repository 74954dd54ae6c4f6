from setuptools import find_packages, setup

setup(
    name="megatron-diloco",
    version="0.1.0",
    description="DiLoCoX (cross-cluster low-communication training) for Megatron-Core",
    packages=find_packages(include=["megatron_diloco", "megatron_diloco.*"]),
    python_requires=">=3.12",  # megatron.training 0.19 imports typing.override
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.19.2,<0.20",
        "numpy",
        "triton",  # imported by megatron.core since 0.19 (also on CPU-only machines)
        "einops",  # --num-distributed-optimizer-instances > 1
        "psutil",  # checkpoint saving
    ],
    extras_require={
        # Transformer Engine's PyTorch extension (builds against the installed torch; NVIDIA's PyTorch
        # containers ship it). NVIDIA Apex has no PyPI release (the PyPI package "apex" is another
        # project): build it from github.com/NVIDIA/apex or use a container that has it.
        "transformer-engine": ["transformer-engine[pytorch]>=2.2,<3"],  # 2.20.2 ran (RESULTS §9.1)
        "te": ["transformer-engine[pytorch]>=2.2,<3"],  # (the same, by its short name)
        # separate jobs per cluster (--diloco-x-lighthouse): torchft's lighthouse, quorum and groups
        "federation": ["torchft>=0.2.0,<0.3"],
        "test": ["pytest"],
        "bench": ["matplotlib>=3.8"],  # the benchmarks' plots (pinned: requirements-bench.txt)
    },
)
