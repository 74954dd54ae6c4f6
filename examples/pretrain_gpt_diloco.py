"""Pretrain a GPT with Megatron-Core and DiLoCoX (megatron-diloco), on GPUs or on CPU.

    torchrun --nproc-per-node 4 examples/pretrain_gpt_diloco.py [megatron and --diloco-x* flags]

With no flags it runs a self-contained CPU-sized demo (``DEMO_ARGS``): a 4-layer byte-level GPT on
the Python standard library sources (``stdlib_corpus.py``), pipeline-parallel 2 x data-parallel 2,
two DiLoCoX replicas. Every flag given on the command line overrides the demo's value (argparse
keeps the last occurrence); ``--no-diloco-x`` turns DiLoCoX off. Giving ``--data-path`` (or
``--mock-data``) replaces the demo corpus; giving ``--tokenizer-type`` replaces its byte tokenizer.

``--transformer-impl transformer_engine`` (Megatron's default; the demo passes ``local``) builds Megatron's
Transformer Engine layers (refused before training where Transformer Engine is not installed).
``--attention-sdpa`` builds the layers with torch's ``scaled_dot_product_attention`` as their core
attention (flash kernels on a GPU) in place of the local spec's unfused ``DotProductAttention``
(``megatron_diloco/megatron_adapter/sdpa_attention.py``); with ``--transformer-impl local`` only.
``--rope-fusion`` turns Megatron's fused RoPE back on (the demo passes ``--no-rope-fusion``); without
Transformer Engine, on a GPU, megatron-diloco's Triton kernel serves it
(``megatron_diloco/megatron_adapter/fused_rope.py``); on CPU it is refused before training.
Without Apex or Transformer Engine, on a GPU, Megatron's gradient norm and clipping run on the package's
multi-tensor kernels instead of Megatron's fallbacks, which read each gradient's norm back to the host
(``megatron_diloco/megatron_adapter/multi_tensor.py``; equal within fp32 rounding).

On a machine without CUDA, ``megatron_diloco.compat.cpu`` patches Megatron-Core to run over gloo;
``compat.distopt_resume`` fixes resuming the distributed optimizer (fp32, or without TE/Apex).
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, uninstalled

import torch

from megatron_diloco import compat

compat.apply_all()  # before Megatron builds anything: CPU shim (no CUDA), resume + wheel fixes

import stdlib_corpus  # noqa: E402  (beside this script)
from megatron.core import mpu  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.utils import (  # noqa: E402
    get_attr_wrapped_model,
    get_batch_on_this_cp_rank,
    get_batch_on_this_tp_rank,
)
from megatron.training import get_args, get_tokenizer, pretrain, print_rank_0  # noqa: E402
from megatron.training.argument_utils import (  # noqa: E402
    core_transformer_config_from_args,
    pretrain_cfg_container_from_args,
)
from megatron.training.arguments import parse_and_validate_args  # noqa: E402
from megatron.training.utils import (  # noqa: E402
    get_blend_and_blend_per_split,
    is_first_or_last_pipeline_stage,
)

import megatron_diloco  # noqa: E402
from megatron_diloco.megatron_adapter import fused_rope, multi_tensor  # noqa: E402
from megatron_diloco.megatron_adapter.integration import destroy_process_groups_at_exit  # noqa: E402
from megatron_diloco.megatron_adapter.sdpa_attention import check_args as check_sdpa_args  # noqa: E402
from megatron_diloco.megatron_adapter.sdpa_attention import get_gpt_layer_sdpa_spec  # noqa: E402

# The demo: ~1M parameters, 16 x 256 tokens per step; falls from ~5.6 to ~2 nats/byte.
MODEL_ARGS = """
    --transformer-impl local --num-layers 4 --hidden-size 192 --ffn-hidden-size 768
    --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256
    --position-embedding-type rope --normalization RMSNorm --disable-bias-linear
    --attention-dropout 0 --hidden-dropout 0 --init-method-std 0.02
""".split()
TRAINING_ARGS = """
    --pipeline-model-parallel-size 2 --use-distributed-optimizer
    --micro-batch-size 4 --global-batch-size 16 --train-iters 300
    --optimizer adam --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 30
    --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0 --seed 1234
    --log-interval 10 --eval-interval 100000 --eval-iters 8
    --no-gradient-accumulation-fusion --no-bias-swiglu-fusion
    --no-masked-softmax-fusion --no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm
    --num-workers 0
""".split()
TOKENIZER_ARGS = f"--tokenizer-type NullTokenizer --vocab-size {stdlib_corpus.VOCAB_SIZE}".split()
# DiLoCoX at the package's defaults (partial overlap with auto tau, eta 1, mu 0, int4), short rounds.
DILOCO_ARGS = "--diloco-x --diloco-x-replicas 2 --diloco-x-local-steps 16".split()
_DATA_FLAGS = ("--data-path", "--mock-data", "--train-data-path", "--per-split-data-args-path",
               "--data-args-path")


def demo_argv(user_argv: list[str]) -> list[str]:
    """The demo defaults followed by the user's flags (the user's win: argparse keeps the last)."""
    given = {a.split("=", 1)[0] for a in user_argv if a.startswith("--")}
    training = TRAINING_ARGS
    if "--train-samples" in given:  # sample-based training: Megatron refuses --train-iters beside it
        at = training.index("--train-iters")
        training = training[:at] + training[at + 2:]
    argv = MODEL_ARGS + training + DILOCO_ARGS
    if "--tokenizer-type" not in given:
        argv += TOKENIZER_ARGS
    if not given.intersection(_DATA_FLAGS):
        argv += ["--data-path", stdlib_corpus.build(), "--split", "98,1,1"]
    return argv + user_argv


def add_script_args(parser):
    parser = megatron_diloco.add_diloco_x_args(parser)
    group = parser.add_argument_group(title="pretrain_gpt_diloco.py")
    group.add_argument("--no-diloco-x", action="store_false", dest="diloco_x",
                       help="Turn DiLoCoX off (plain Megatron training with the same settings).")
    group.add_argument("--attention-sdpa", action="store_true",
                       help="Core attention through torch.nn.functional.scaled_dot_product_attention "
                            "(flash or memory-efficient kernels on a GPU, causal mask) instead of the "
                            "local spec's unfused DotProductAttention; same results within rounding, "
                            "less memory, so larger micro-batches fit. The data loader's attention mask "
                            "is not read (causal attention): add --no-create-attention-mask-in-dataloader "
                            "to stop building it. Needs --transformer-impl local; refuses context "
                            "parallelism, --reset-attention-mask, sliding windows and "
                            "--multi-latent-attention.")
    group.add_argument("--rope-fusion", action="store_true", dest="apply_rope_fusion",
                       help="Megatron's fused RoPE, which the demo's --no-rope-fusion turns off (Megatron has "
                            "only that flag: fusion is its default). Without Transformer Engine, on a GPU, "
                            "megatron-diloco's Triton kernel serves it (megatron_adapter/fused_rope.py); on CPU "
                            "it is refused: no kernel there.")
    return parser


# --- model -------------------------------------------------------------------------------------


def check_transformer_impl(args) -> None:
    """``--transformer-impl transformer_engine`` (Megatron's default; the demo passes ``local``) needs
    Transformer Engine importable (Megatron's own ``HAVE_TE``): refused before anything is built when it is
    not, naming the fix."""
    from megatron.core.extensions import transformer_engine as te_extension

    if args.transformer_impl == "transformer_engine" and not te_extension.HAVE_TE:
        raise SystemExit("pretrain_gpt_diloco.py: error: --transformer-impl transformer_engine needs Transformer "
                         "Engine, which is not installed (pip install 'megatron-diloco[transformer-engine]' on a "
                         "CUDA machine); without it give --transformer-impl local (the demo's)")


def layer_spec(args):
    """The layers' ModuleSpec: Megatron's Transformer Engine spec with ``--transformer-impl
    transformer_engine``; else Megatron-Core's local modules (with ``--attention-sdpa``, SDPA as the core
    attention)."""
    if args.transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=getattr(args, "qk_layernorm", False))
    # (a script that imports this provider without the example's flags gets the local spec)
    spec = get_gpt_layer_sdpa_spec if getattr(args, "attention_sdpa", False) else get_gpt_layer_local_spec
    return spec(normalization=args.normalization)


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None,
                   pg_collection=None):
    """One pipeline stage (or virtual stage) of a GPT from :func:`layer_spec`."""
    args = get_args()
    config = config or core_transformer_config_from_args(args)
    print_rank_0(f"> building GPT stage (pre_process={pre_process}, post_process={post_process})")
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(args),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )


# --- data --------------------------------------------------------------------------------------


def is_dataset_built_on_rank(vp_stage=None):
    # Only the stages that consume tokens (first: inputs, last: labels) read data, on TP rank 0.
    return is_first_or_last_pipeline_stage(vp_stage) and mpu.get_tensor_model_parallel_rank() == 0


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building {dataset_type.__name__} train/valid/test splits ...")
    return BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples, partial(is_dataset_built_on_rank, vp_stage=vp_stage),
        config,
    ).build()


train_valid_test_datasets_provider.is_distributed = True  # called on every rank


def get_batch(data_iterator, vp_stage=None):
    """tokens, labels, loss_mask, attention_mask, position_ids of this rank's micro-batch."""
    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None
    args = get_args()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        batch = {k: (v.cuda(non_blocking=True) if isinstance(v, torch.Tensor) else v)
                 for k, v in next(data_iterator).items()}
    if args.tensor_model_parallel_size > 1:  # TP rank 0 read the data: broadcast it to the others
        batch = get_batch_on_this_tp_rank(
            batch, has_cu_seqlens=False, is_hybrid_cp=False,
            create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
            broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
            broadcast_group=mpu.get_tensor_model_parallel_group(), cp_size=args.context_parallel_size,
            tp_rank=tp_rank, micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
            mtp_on_this_rank=False, pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
            is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
        )
    if args.context_parallel_size > 1:
        batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False,
                                          cp_group=mpu.get_context_parallel_group())
    keys = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
    return tuple(batch.get(k) for k in keys)


# --- step --------------------------------------------------------------------------------------


def loss_func(loss_mask, output_tensor):
    """Summed token loss, token count, and the 'lm loss' report Megatron averages for logging."""
    losses = output_tensor.view(-1).float()  # (micro_batch * seq,) per-token cross entropy
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    vp_stage = get_attr_wrapped_model(model, "vp_stage")  # under the DDP / Float16Module wrappers
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, vp_stage)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask)


def main() -> None:
    # with --diloco-x, install() registers it; vanilla runs (the benchmarks' baseline) get it too
    destroy_process_groups_at_exit()
    sys.argv[1:] = demo_argv(sys.argv[1:])
    args = parse_and_validate_args(extra_args_provider=add_script_args)
    check_transformer_impl(args)
    if args.attention_sdpa:
        check_sdpa_args(args, flag="--attention-sdpa")
    fused_rope.install(args)  # rope fusion without Transformer Engine: the Triton kernel (refused on CPU)
    multi_tensor.install(args)  # without Apex or Transformer Engine: the gradient norm without host syncs
    if args.diloco_x:
        megatron_diloco.install(args)  # validates the flags, sets the replica topology
    pretrain(
        pretrain_cfg_container_from_args(args),
        train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        model_provider=model_provider,
    )


if __name__ == "__main__":
    main()
