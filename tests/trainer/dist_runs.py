"""Every training of tests/trainer/test_distributed.py, and what it is checked against: one table.

Two-process runs go through one torchrun launch (dist_worker.py); one-process runs through
`oomless train`. A test takes its cases from the rows whose `check` it asserts.
"""

from __future__ import annotations

from dataclasses import dataclass

STEPS = 10
RESUME_AT = 4  # the straight runs write checkpoints/step_4 and step_8; resumed runs step_8
# Bit-exact resumes stop at step 6: not the first checkpoint, and a step after which CPU Adam's
# running beta2^t and pow(beta2, t) differ (steps 6-8 for beta2 0.95), so a resume that rebuilt
# it with a power would drift from step 8 on; from step 4 they agree by luck.
STOP_AT = 6
EVERY_2 = ("run.checkpoint_every=2", "run.keep_checkpoints=5")  # step_2 .. step_8, all kept


@dataclass(frozen=True)
class Run:
    name: str
    overrides: tuple[str, ...]
    world_size: int = 2
    # what the test asserts: "fp32" (losses within 1e-4 of `against`), "bf16" (within 2e-2),
    # "backoff" (an injected OOM at step 3 halves the micro-batch; losses within 1e-5 of
    # `against` from step 3 on), "resume" (steps 5-10 and the moments equal `against`'s),
    # "levers" (the memory levers on: losses within 1e-6 of the same rung with them off),
    # "pretrained" (step 1's loss within 1e-5 of `against`'s),
    # "learns" (the loss falls: QLoRA, whose 4-bit base no other run shares),
    # "full_disk" (each rank's outcome_rank{R}.json: the same one-line ConfigError),
    # "stream" (the stream rung: losses and grad norms within 1e-6 of `against`),
    # "tensor" (losses within 1e-5 of `against`: a tensor split, trainer/parallel/tensor.py),
    # "expert" (losses within 1e-5 of `against`: an expert split, trainer/parallel/expert.py)
    check: str | None = None
    against: str = "single_fp32"
    exact: bool = False  # resume: bit-identical losses
    copy_from: str | None = None  # one-process resume: the checkpoint copied in from this run
    resume_at: int = RESUME_AT  # resume: the step of the checkpoint it starts from
    needs_nvme: bool = False  # DeepSpeed's async_io op (libaio)
    # full_disk: ENOSPC injected on this rank (after `slow_s`) inside its DCP shard of step_4
    full_disk: tuple[int, float] | None = None


def _resume(
    name: str, source: str, strategy: str, against: str, at: int = RESUME_AT,
    extra: tuple[str, ...] = (), **kw,
) -> Run:  # fmt: skip
    """Resume from `source`'s step-`at` checkpoint and train to STEPS (checkpoint at step 8);
    `extra`: overrides beside the strategy (the model of the source run; stream's checkpointing)."""
    overrides = (f"strategy={strategy}", "run.checkpoint_every=4", *extra)
    if kw.get("world_size", 2) == 2:
        overrides += (f"run.resume={{work}}/{source}/checkpoints/step_{at}",)
    else:
        kw["copy_from"] = source
    return Run(name, overrides, check="resume", against=against, resume_at=at, **kw)


def _oom(name: str, strategy: str, where: str, against: str) -> Run:
    inject = f"debug.inject_oom={{step: 3, rank: 1, times: 1, where: {where}}}"
    return Run(name, (f"strategy={strategy}", inject), check="backoff", against=against)


NVME = "deepspeed.nvme_path={work}/nvme_swap"
# `stream` recomputes every layer: the base config's checkpointing `none` is refused for it
STREAM = ("strategy=stream", "memory.activation_checkpointing=full")
# from the model test_distributed.py saves with save_pretrained (sharded safetensors, tied
# embeddings): one step, whose loss is the pretrained model's loss on the first batch
PRETRAINED = ("model.name_or_path={work}/pretrained", "model.config=null", "train.steps=1")
_SMALL = (
    "vocab_size: 45, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, "
    "num_key_value_heads: 2, head_dim: 8, max_position_embeddings: 256, pad_token_id: 0, "
    "bos_token_id: 1, eos_token_id: 2"
)
# tensor parallel over 2 ranks (its 2 attention and 1 key/value heads each): Llama, Qwen2 (biased
# q/k/v), Qwen3 (q/k norms replicated, their gradients all-reduced by transformers' plan)
TP2 = ("strategy=single", "parallel.tensor=2")
TENSOR_MODELS = {
    name: "{model_type: " + name + ", " + _SMALL + ", intermediate_size: 64}"
    for name in ("qwen2", "qwen3")
}
MODELS = {  # inline HF configs as `model.config=` overrides
    "gemma3_text": "{model_type: gemma3_text, " + _SMALL + ", intermediate_size: 64, "
    "sliding_window: 16, layer_types: [sliding_attention, full_attention]}",
    "qwen3_moe": "{model_type: qwen3_moe, " + _SMALL + ", intermediate_size: 64, "
    "moe_intermediate_size: 32, num_experts: 4, num_experts_per_tok: 2}",
}
# expert parallel over 2 ranks (each MoE layer's 4 experts, 2 a rank; top-2 routing): Qwen3-MoE,
# Mixtral, gpt-oss (attention sinks, biased experts, sliding and full attention layers)
EP2 = ("strategy=fsdp", "parallel.expert=2")
EXPERT_MODELS = {
    "qwen3_moe": MODELS["qwen3_moe"],
    "mixtral": "{model_type: mixtral, " + _SMALL + ", intermediate_size: 32, "
    "num_local_experts: 4, num_experts_per_tok: 2}",
    "gpt_oss": "{model_type: gpt_oss, " + _SMALL + ", intermediate_size: 32, "
    "num_local_experts: 4, num_experts_per_tok: 2, sliding_window: 16, "
    "layer_types: [sliding_attention, full_attention]}",
}
EVERY_4 = ("run.checkpoint_every=4",)
# LoRA (trainer/model/finetune.py): adapters on every linear layer of the blocks, a frozen base
LORA = ("finetune.method=lora", "finetune.lora.r=4", "finetune.lora.alpha=8")
QLORA = ("finetune.method=qlora", "precision=bf16", "train.lr=1e-2")
# DPO (docs/preference.md) on the 16 pairs test_distributed.py writes: one global batch, so the
# loss falls from ln 2 every step; full (a precomputed reference pass over both ranks) and LoRA
# (adapters off in each step's no-grad forward inside FSDP2's units)
DPO = ("data.path={work}/pairs.jsonl", "data.format=preference", "objective.type=dpo")
RUNS: tuple[Run, ...] = (
    # one process: the references
    Run("single_fp32", ("run.checkpoint_every=4",), world_size=1),
    Run("single_bf16", ("precision=bf16",), world_size=1),
    # transformers' own from_pretrained: the reference of the per-rank loads below
    Run("single_pretrained", PRETRAINED, world_size=1),
    Run("single_lora_fp32", (*LORA, "run.checkpoint_every=4"), world_size=1),
    # each decoder layer torch.compiled inside its (selective) checkpoint wrapper
    Run("single_compiled", ("train.compile=true", "memory.activation_checkpointing=selective"),
        world_size=1, check="fp32"),
    Run("single_dpo_fp32", DPO, world_size=1),
    Run("single_dpo_lora_fp32", (*DPO, *LORA), world_size=1),
    # layers streamed from host memory (trainer/backends/stream.py); then each layer's kept
    # input in host memory (the activation-offload lever's hooks), with the copy threads slowed
    # so that a missing wait would read a buffer before its copy lands
    Run("stream_fp32", (*STREAM, "memory.offload_activations=false", "run.checkpoint_every=4"),
        world_size=1, check="stream"),
    Run("stream_offload_delay_fp32", (*STREAM, "memory.offload_activations=true",
                                      "debug.stream_copy_delay_s=0.002"),
        world_size=1, check="stream"),
    # two processes: every backend against one process
    Run("ddp_fp32", ("strategy=ddp",), check="fp32"),
    Run("fsdp_dpo_fp32", ("strategy=fsdp", *DPO), check="fp32", against="single_dpo_fp32"),
    Run("fsdp_dpo_lora_fp32", ("strategy=fsdp", *DPO, *LORA), check="fp32",
        against="single_dpo_lora_fp32"),
    # each rank reads its FSDP shard / ZeRO-3 partition from the safetensors files
    Run("fsdp_pretrained", ("strategy=fsdp", *PRETRAINED), check="pretrained",
        against="single_pretrained"),
    Run("zero3_pretrained", ("strategy=zero3", *PRETRAINED), check="pretrained",
        against="single_pretrained"),
    Run("fsdp_fp32", ("strategy=fsdp", *EVERY_2), check="fp32"),
    Run("fsdp_offload_fp32", ("strategy=fsdp_offload",), check="fp32"),
    # gradients reduce-scattered after each of the 2 micro-batches, accumulated sharded
    Run("fsdp_every_micro_fp32", ("strategy=fsdp", "fsdp.reduce_every_micro_batch=true"),
        check="fp32"),
    # HSDP: the two ranks as two "nodes" of one device each: replicate x shard = 2 x 1
    Run("fsdp_hybrid_fp32", ("strategy=fsdp", "fsdp.hybrid=true", "hardware.nodes=2",
                             "hardware.devices_per_node=1"), check="fp32"),
    # each decoder layer torch.compiled, inside its checkpoint wrapper and under fully_shard
    Run("fsdp_compiled_fp32", ("strategy=fsdp", "train.compile=true",
                               "memory.activation_checkpointing=full"), check="fp32"),
    # the exact memory levers against the same rung without them: chunked loss over 6 chunks of
    # a micro-batch's 128 positions, activation offload, both with full recomputation (ZeRO-3
    # leaves out offload alone, to save a DeepSpeed start: the both-levers run has it)
    *(
        Run(f"{strategy}_{name}", (f"strategy={strategy}", *levers), check="levers",
            against=f"{strategy}_fp32")
        for strategy in ("fsdp", "zero3")
        for name, levers in (
            ("chunked_loss", ("memory.chunked_loss=true", "memory.loss_chunk_tokens=24")),
            ("offload_activations", ("memory.offload_activations=true",)),
            ("both_levers_full", ("memory.chunked_loss=true", "memory.loss_chunk_tokens=24",
                                  "memory.offload_activations=true",
                                  "memory.activation_checkpointing=full")),
        )
        if (strategy, name) != ("zero3", "offload_activations")
    ),
    Run("ddp_bf16", ("strategy=ddp", "precision=bf16"), check="bf16", against="single_bf16"),
    Run("fsdp_bf16", ("strategy=fsdp", "precision=bf16"), check="bf16", against="single_bf16"),
    Run("zero2_bf16", ("strategy=zero2", "precision=bf16"), check="bf16", against="single_bf16"),
    Run("zero3_offload_bf16", ("strategy=zero3_offload", "precision=bf16"), check="bf16",
        against="single_bf16"),
    Run("ddp_micro2", ("strategy=ddp", "train.micro_batch_size=2")),
    _oom("ddp_oom_rank1_step3", "ddp", "backward", against="ddp_micro2"),
    # an OOM on rank 1 at step 3 on ZeRO: before backward, and at the entry of the optimizer
    # step (DeepSpeed's step holds collectives: the ranks must agree before it)
    *(
        _oom(f"{strategy}_oom_{where}", strategy, where, against=f"{strategy}_fp32")
        for strategy in ("zero2", "zero3")
        for where in ("backward", "optimizer")
    ),
    # architectures other than the base llama: sliding/global attention with a
    # non-persistent embedding scale, and a mixture of experts
    *(
        run
        for name, config in MODELS.items()
        for run in (
            Run(f"single_{name}", (f"model.config={config}",
                                   *(EVERY_4 if name == "qwen3_moe" else ())), world_size=1),
            Run(f"fsdp_{name}", ("strategy=fsdp", f"model.config={config}",
                                 *(EVERY_4 if name == "qwen3_moe" else ())),
                check="fp32", against=f"single_{name}"),
        )
    ),
    Run("zero1_fp32", ("strategy=zero1",), check="fp32"),
    Run("zero2_fp32", ("strategy=zero2", *EVERY_2), check="fp32"),
    Run("zero3_fp32", ("strategy=zero3", "run.checkpoint_every=4"), check="fp32"),
    Run("zero3_offload_fp32", ("strategy=zero3_offload", *EVERY_2), check="fp32"),
    Run("zero3_offload_params_fp32", ("strategy=zero3_offload_params", *EVERY_2), check="fp32"),
    # ZeRO-Infinity: parameters and optimizer state swapped through files (async_io, libaio)
    Run("zero3_nvme_fp32", ("strategy=zero3_nvme", NVME, "run.checkpoint_every=4"),
        check="fp32", needs_nvme=True),
    # the same rung on the same ranks, stopped at step 6: bit-identical to the end (the CPU Adam
    # rungs too, since the backend replays CPU Adam's running beta^t; ZeRO-2 for torch AdamW
    # under DeepSpeed)
    *(
        _resume(f"{name}_resumed", f"{name}_fp32", name, against=f"{name}_fp32", at=STOP_AT,
                exact=True)
        for name in ("fsdp", "zero2", "zero3_offload", "zero3_offload_params")
    ),
    # LoRA on every kind of engine (a frozen base inside each DDP replica, FSDP2 unit, ZeRO-3
    # partition) learns what one process learns; its adapter checkpoint moves between rungs;
    # QLoRA's 4-bit base on two DDP replicas learns (bf16)
    *(
        Run(f"{strategy}_lora_fp32", (f"strategy={strategy}", *LORA), check="fp32",
            against="single_lora_fp32")
        for strategy in ("ddp", "fsdp", "zero3")
    ),
    Run("fsdp_lora_from_single", ("strategy=fsdp", *LORA, "run.checkpoint_every=4",
                                  f"run.resume={{work}}/single_lora_fp32/checkpoints/step_{RESUME_AT}"),
        check="resume", against="single_lora_fp32"),
    Run("ddp_qlora_bf16", ("strategy=ddp", *QLORA), check="learns"),
    # ... and partitioned by ZeRO-3 learns what the replicas learn, and resumes bit for bit
    Run("zero3_qlora_bf16", ("strategy=zero3", *QLORA, *EVERY_2), check="bf16",
        against="ddp_qlora_bf16"),
    Run("zero3_qlora_resumed", ("strategy=zero3", *QLORA, "run.checkpoint_every=4",
                                f"run.resume={{work}}/zero3_qlora_bf16/checkpoints/step_{STOP_AT}"),
        check="resume", against="zero3_qlora_bf16", resume_at=STOP_AT, exact=True),
    # checkpoints moving between rungs and world sizes
    _resume("fsdp_from_single", "single_fp32", "fsdp", against="single_fp32"),
    _resume("zero3_offload_from_fsdp", "fsdp_fp32", "zero3_offload", against="fsdp_fp32"),
    # into and out of the stream rung (its host buffers hold the same canonical state)
    _resume("fsdp_from_stream", "stream_fp32", "fsdp", against="stream_fp32"),
    # moments loaded into optimizer state that lives on NVMe
    Run("zero3_nvme_from_fsdp", ("strategy=zero3_nvme", "deepspeed.nvme_path={work}/nvme_resumed",
                                 "run.checkpoint_every=4",
                                 f"run.resume={{work}}/fsdp_fp32/checkpoints/step_{RESUME_AT}"),
        check="resume", against="fsdp_fp32", needs_nvme=True),
    # tensor parallel (trainer/parallel/tensor.py): 2 ranks of one tensor group against one
    # process, on three architectures and from pretrained weights each rank reads its blocks
    # of; its checkpoint resumed on fsdp, and fsdp's resumed under the split
    Run("tp2_fp32", (*TP2, "run.checkpoint_every=4"), check="tensor"),
    *(
        run
        for name, config in TENSOR_MODELS.items()
        for run in (
            Run(f"single_{name}", (f"model.config={config}",), world_size=1),
            Run(f"tp2_{name}", (*TP2, f"model.config={config}"), check="tensor",
                against=f"single_{name}"),
        )
    ),
    Run("tp2_pretrained", (*TP2, *PRETRAINED), check="pretrained", against="single_pretrained"),
    _resume("fsdp_from_tp2", "tp2_fp32", "fsdp", against="tp2_fp32"),
    Run("tp2_from_fsdp", (*TP2, "run.checkpoint_every=4",
                          f"run.resume={{work}}/fsdp_fp32/checkpoints/step_{RESUME_AT}"),
        check="resume", against="fsdp_fp32"),
    # an OOM on one rank of the tensor group: both halve the micro-batch (one data rank)
    Run("tp2_oom_backward",
        (*TP2, "debug.inject_oom={step: 3, rank: 1, times: 1, where: backward}"),
        check="backoff", against="tp2_fp32"),
    # expert parallel (trainer/parallel/expert.py): each MoE layer's experts split over the 2
    # ranks, the dense weights under FSDP over both, against one process on three architectures;
    # its checkpoint resumed on fsdp and on one process, and theirs resumed under the split
    *(
        Run(f"single_{name}", (f"model.config={config}",), world_size=1)
        for name, config in EXPERT_MODELS.items()
        if name not in MODELS
    ),
    *(
        Run(f"ep2_{name}", (*EP2, f"model.config={config}",
                            *(EVERY_4 if name == "qwen3_moe" else ())),
            check="expert", against=f"single_{name}")
        for name, config in EXPERT_MODELS.items()
    ),
    # ... and LoRA on the split model: adapters on the attention, the experts frozen
    Run("single_lora_qwen3_moe", (*LORA, f"model.config={MODELS['qwen3_moe']}"), world_size=1),
    Run("ep2_lora_qwen3_moe", (*EP2, *LORA, f"model.config={MODELS['qwen3_moe']}"),
        check="expert", against="single_lora_qwen3_moe"),
    _resume("fsdp_from_ep2", "ep2_qwen3_moe", "fsdp", against="ep2_qwen3_moe",
            extra=(f"model.config={MODELS['qwen3_moe']}",)),
    Run("ep2_from_fsdp", (*EP2, f"model.config={MODELS['qwen3_moe']}", *EVERY_4,
                          f"run.resume={{work}}/fsdp_qwen3_moe/checkpoints/step_{RESUME_AT}"),
        check="resume", against="fsdp_qwen3_moe"),
    Run("ep2_from_single", (*EP2, f"model.config={MODELS['qwen3_moe']}", *EVERY_4,
                            f"run.resume={{work}}/single_qwen3_moe/checkpoints/step_{RESUME_AT}"),
        check="resume", against="single_qwen3_moe"),
    # two-process checkpoints resumed on one process (a process group of one for fsdp)
    _resume("single_from_fsdp", "fsdp_fp32", "single", against="fsdp_fp32", world_size=1),
    _resume("fsdp1_from_fsdp2", "fsdp_fp32", "fsdp", against="fsdp_fp32", world_size=1),
    _resume("single_from_zero3", "zero3_fp32", "single", against="zero3_fp32", world_size=1),
    _resume("single_from_ep2", "ep2_qwen3_moe", "single", against="ep2_qwen3_moe", world_size=1,
            extra=(f"model.config={MODELS['qwen3_moe']}",)),
    _resume("stream_from_single", "single_fp32", "stream", against="single_fp32", world_size=1,
            exact=True, extra=STREAM[1:]),
    # last (a path where the ranks disagree would leave the process group unusable): a full
    # disk at step_4 on one rank, inside torch.save (the error DCP passes on has lost its
    # cause), that rank slowed or not; every rank must leave with the same one line
    *(
        Run(f"fsdp_full_disk_rank{rank}_slow{slow_s:g}", ("strategy=fsdp", "train.steps=4",
            "run.checkpoint_every=2", "run.keep_checkpoints=5", "dist.timeout_s=60"),
            check="full_disk", full_disk=(rank, slow_s))
        for rank, slow_s in ((1, 0.0), (1, 2.0), (0, 2.0))
    ),
)  # fmt: skip


def checked(check: str) -> list[Run]:
    return [run for run in RUNS if run.check == check]
