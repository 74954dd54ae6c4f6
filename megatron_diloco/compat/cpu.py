"""Megatron-Core 0.19 on CPU over gloo.

Megatron-Core assumes CUDA in a few dozen places on the training path: it asks
``torch.cuda`` for the current device, streams and RNG state, allocates with ``device="cuda"`` or
``.cuda()``, checks ``tensor.type() == 'torch.cuda.FloatTensor'`` and only builds its parallel
groups when a GPU is visible. :func:`apply` patches those call sites process-wide so that the
unmodified ``megatron.training.pretrain`` runs on CPU ranks over gloo (tests, the CPU demo, laptops).

Rules:

* Only on CPU. With a GPU present :func:`apply` changes nothing and says so in the log; nothing
  here ever replaces a working CUDA path.
* Process-wide and irreversible: apply it in the process that runs Megatron (a torchrun rank),
  before Megatron builds anything, never inside a test runner that does other work.
* Each patch names the Megatron 0.19.2 call sites it serves (``file:line``).

What still differs from a GPU run: the tensor-parallel RNG tracker is a no-op (dropout inside
TP regions draws from the default CPU generator), so resume with ``--no-load-rng``; use
``--transformer-impl local``. Megatron's default ``--rerun-mode validate_results`` works (its RNG
snapshots read the CPU generator).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

_applied = False
_mode: TorchFunctionMode | None = None


def cpu_mode() -> bool:
    """True when this process has no usable CUDA device (the shim is needed and allowed)."""
    return not torch.cuda.is_available()


def apply() -> None:
    """Apply every CPU patch once (idempotent). Does nothing, and logs that, when CUDA is available."""
    global _applied
    if _applied:
        return
    if not cpu_mode():
        logger.info("megatron_diloco.compat.cpu: CUDA is available, no CPU patches applied")
        return
    _patch_torch_cuda()
    _enter_cuda_to_cpu_mode()
    _patch_megatron()
    _applied = True
    logger.info("megatron_diloco.compat.cpu: Megatron-Core patched for CPU/gloo")


# ---------------------------------------------------------------------------------------------
# 1. torch.cuda device / stream / RNG functions
# ---------------------------------------------------------------------------------------------


class _CpuStream:
    """Stands in for ``torch.cuda.Stream``: CPU work is synchronous, so every wait is a no-op."""

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_DEFAULT_STREAM = _CpuStream()


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    # Device index for `device=torch.cuda.current_device()` allocations (training.py:1818,
    # param_and_grad_buffer.py:1180/1186, timers.py:303, utils.py:715 GlobalMemoryBuffer,
    # p2p_communication.py:334/342, rotary_pos_embedding.py:78). Index 0 is what a one-GPU rank
    # would see; the TorchFunctionMode below maps it to CPU wherever it reaches a tensor.
    cuda.current_device = lambda: 0
    # Host/device barriers (timers.py:152/165, p2p_communication.py:419, parallel_state.py):
    # CPU ops complete before they return.
    cuda.synchronize = lambda device=None: None
    # Side streams (training.py:1876-1896 DDP-wrapping stream, param_and_grad_buffer.py:632).
    cuda.Stream = lambda *args, **kwargs: _CpuStream()
    cuda.current_stream = lambda device=None: _DEFAULT_STREAM
    cuda.default_stream = lambda device=None: _DEFAULT_STREAM
    cuda.stream = lambda stream=None: contextlib.nullcontext(stream)
    cuda.set_stream = lambda stream: None
    # RNG state saved in checkpoints (checkpointing.py:417) and by the rerun state machine
    # (rerun_state_machine.py:979). There is no device generator: report the CPU state, and
    # restore nothing (the CPU state is restored from 'torch_rng_state', checkpointing.py:2664).
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda new_state, device="cuda": None


# ---------------------------------------------------------------------------------------------
# 2. device="cuda", .cuda(), .to(cuda) and Tensor.type() on every torch call
# ---------------------------------------------------------------------------------------------


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int is a CUDA ordinal (torch.cuda.current_device()); bool is an int but never a device.
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placements to CPU on every torch call of the thread that entered it.

    Serves hard-coded ``device='cuda'`` / ``device=torch.cuda.current_device()``
    (training.py:1137/2613/2884/4587, schedules.py:749/1121/2292, clip_grads.py:108/112,
    optimizer.py:315/698/702/1249), ``module.cuda(...)`` (training.py:1818) and ``tensor.cuda()``.
    Also makes ``tensor.type()`` report ``torch.cuda.*Tensor`` for CPU tensors: the distributed
    optimizer and grad clipping dispatch on those strings (distrib_optimizer.py:401/466/758,
    optimizer.py:1009/1028, clip_grads.py:174).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]  # already on the only device there is, like .cuda() on a CUDA tensor
        if func is torch.Tensor.to:
            args = tuple("cpu" if i > 0 and _is_cuda_device(a) else a for i, a in enumerate(args))
        if _is_cuda_device(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        result = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(result, str):
            result = result.replace("torch.", "torch.cuda.", 1)
        return result


def _enter_cuda_to_cpu_mode() -> None:
    # Entered for good (never exited): TorchFunctionMode stacks are per thread; Megatron's training
    # path (forward, CPU backward, optimizer, checkpointing) runs on the main thread.
    global _mode
    _mode = _CudaToCpuMode()
    _mode.__enter__()


# ---------------------------------------------------------------------------------------------
# 3. megatron.training initialization
# ---------------------------------------------------------------------------------------------


def _patch_megatron() -> None:
    import megatron.core.datasets.utils as dataset_utils
    import megatron.training.arguments as arguments
    import megatron.training.initialize as initialize
    import megatron.training.training as training

    # initialize.py:66 asserts CUDA unless allow_no_cuda; pretrain() calls it without
    # (training.py imports the name, so patch both module attributes).
    original_init = initialize.initialize_megatron

    @functools.wraps(original_init)
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original_init(*args, **kwargs)

    initialize.initialize_megatron = initialize_megatron
    training.initialize_megatron = initialize_megatron

    # initialize.py:270-346 initializes torch.distributed with args.distributed_backend (default
    # nccl) and builds the parallel groups only `if device_count > 0`: use gloo, then build them.
    original_init_dist = initialize._initialize_distributed

    @functools.wraps(original_init_dist)
    def _initialize_distributed(get_embedding_ranks, get_position_embedding_ranks, store,
                                skip_model_parallel_init=False):
        from megatron.training.global_vars import get_args

        args = get_args()
        if args.distributed_backend != "gloo":
            logger.info("CPU: --distributed-backend %s -> gloo", args.distributed_backend)
            args.distributed_backend = "gloo"
        original_init_dist(get_embedding_ranks, get_position_embedding_ranks, store,
                           skip_model_parallel_init=skip_model_parallel_init)
        if not skip_model_parallel_init:
            _initialize_model_parallel(args, get_embedding_ranks, get_position_embedding_ranks)

    initialize._initialize_distributed = _initialize_distributed

    # initialize.py:447 seeds the tensor-parallel RNG tracker only when a GPU is visible, and
    # its CUDA generators do not exist here: install the tracker whose fork() is a no-op.
    original_seed = initialize._set_random_seed

    @functools.wraps(original_seed)
    def _set_random_seed(*args, **kwargs):
        original_seed(*args, **kwargs)
        from megatron.core.tensor_parallel.random import initialize_rng_tracker

        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)

    initialize._set_random_seed = _set_random_seed

    # initialize.py:497 (_warmup_jit_function, called by set_jit_fusion_options from
    # training.py:1117) compiles the fused bias-GeLU/SwiGLU and bias-dropout-add functions through
    # torch.compile on "cuda" tensors, whatever the fusion flags say: on CPU an inductor C++ build,
    # ~3-7 s of CPU per rank at every start (most of a short CPU run's start-up). Skip it: a fused
    # function a CPU run does use still compiles at its first call.
    initialize._warmup_jit_function = lambda tp_size=None: None

    # initialize.py:_compile_dependencies runs `make` for the dataset helpers and sys.exit(1)s
    # without a toolchain; the wheel ships them compiled (megatron/core/datasets/helpers_cpp*.so).
    dataset_utils.compile_helpers = lambda: None

    # arguments.py:1414 reads the GPU architecture when TP or CP > 1 and then asserts
    # CUDA_DEVICE_MAX_CONNECTIONS=1 (a GPU kernel-ordering requirement, meaningless on CPU).
    arguments.get_device_arch_version = lambda: 0
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")


def _initialize_model_parallel(args, get_embedding_ranks, get_position_embedding_ranks) -> None:
    """The ``mpu.initialize_model_parallel`` call of initialize.py:349-383, made on CPU."""
    from megatron.core import mpu

    if mpu.model_parallel_is_initialized():
        return
    mpu.initialize_model_parallel(
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.virtual_pipeline_model_parallel_size,
        pipeline_model_parallel_comm_backend=args.pipeline_model_parallel_comm_backend,
        context_parallel_size=args.context_parallel_size,
        hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes,
        hybrid_context_parallel=args.hybrid_context_parallel,
        expert_model_parallel_size=args.expert_model_parallel_size,
        # Without these two, --num-distributed-optimizer-instances > 1 fails ("inter distributed
        # optimizer instance group ... not initialized") and --use-tp-pp-dp-mapping is ignored.
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        order="tp-cp-ep-pp-dp" if args.use_tp_pp_dp_mapping else "tp-cp-ep-dp-pp",
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        get_embedding_ranks=get_embedding_ranks,
        get_position_embedding_ranks=get_position_embedding_ranks,
        create_gloo_process_groups=args.use_gloo_process_groups,
    )
