"""The exact memory levers on one process: chunked loss and activation offload change where the
bytes live, not what is learned (fp32 losses within 1e-6 relative over 10 steps), and the
offload hooks move exactly the saved activations out and back."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.conftest import TINY_LLAMA
from trainer.backends import BackendContext, OptimizerSpec, build_backend
from trainer.core.config import build_config
from trainer.loss import IGNORE_INDEX
from trainer.memory.levers import MemoryLevers
from trainer.model.build import HFModelFactory
from trainer.step import train_step

SEQ = 16
STEPS = 10
CPU = torch.device("cpu")
GEMMA2 = {  # final logit soft-capping, tied head
    **TINY_LLAMA,
    "model_type": "gemma2",
    "head_dim": 8,
    "final_logit_softcapping": 3.0,
    "attn_logit_softcapping": None,
    "tie_word_embeddings": True,
}
MODELS = {
    "llama_untied": TINY_LLAMA,
    "llama_tied": {**TINY_LLAMA, "tie_word_embeddings": True},
    "gemma2_softcap_tied": GEMMA2,
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls: one thread is ~10x faster than a pool spinning on a loaded machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class _Matmuls(TorchDispatchMode):
    """Counts the matrix products a step runs (forward, recompute, backward)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return func(*args, **(kwargs or {}))


def _train(
    tmp_path, hf_config: dict, ac: str = "none", checkpointed: int | None = None,
    selective: str = "auto", **levers,
) -> tuple[list[float], dict]:  # fmt: skip
    """10 steps of 2 micro-batches x 2 rows on the single backend (`checkpointed` layers under
    selective checkpointing); the per-step losses and the last step's lever record."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "x"}\n')
    cfg = build_config(
        {
            "model": {
                "config": hf_config,
                "tokenizer": str(tmp_path),
                # Gemma 2's attention has no SDPA path in transformers
                "attn_implementation": "eager" if hf_config is GEMMA2 else "sdpa",
            },
            "data": {"path": str(data), "seq_len": SEQ},
            "train": {"global_batch_size": 4, "micro_batch_size": 2},
            "memory": {"checkpointed_layers": checkpointed or "auto", "selective": selective},
            "strategy": "single",
        }
    )
    ctx = BackendContext(
        cfg=cfg,
        device=CPU,
        rank=0,
        local_rank=0,
        world_size=1,
        precision="fp32",
        activation_checkpointing=ac,
        micro_batch_size=2,
        grad_accum=2,
    )
    backend = build_backend("single", ctx)
    optim = OptimizerSpec(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=1.0)
    model = backend.setup(HFModelFactory(cfg.model, seed=0), optim)
    on = MemoryLevers(
        model,
        CPU,
        chunked_loss=levers.get("chunked_loss", False),
        offload_activations=levers.get("offload_activations", False),
        loss_chunk_tokens=5,  # 32 positions per micro-batch: 7 chunks, the last one short
    )
    losses, record = [], {}
    g = torch.Generator().manual_seed(0)
    fixed = torch.randint(0, hf_config["vocab_size"], (4, SEQ), generator=g)
    for _ in range(STEPS):
        ids = fixed
        labels = ids.clone()
        labels[1, :6] = IGNORE_INDEX  # a prompt
        labels[3, 9:] = IGNORE_INDEX  # padding
        batch = {"input_ids": ids, "labels": labels, "doc_ids": torch.zeros_like(ids)}
        micro = [{k: v[i : i + 2] for k, v in batch.items()} for i in (0, 2)]
        with _Matmuls() as matmuls:
            losses.append(train_step(model, backend, micro, CPU).loss)
        record = on.record() | {"matmuls": matmuls.count}
    return losses, record


def _assert_same(got: list[float], ref: list[float], what: str) -> None:
    assert len(got) == STEPS
    for step, (a, b) in enumerate(zip(got, ref, strict=True), start=1):
        assert abs(a - b) <= 1e-6 * abs(b), f"step {step}: {what} {a} vs off {b}"
    assert ref[-1] < ref[0]  # it learned


@pytest.mark.parametrize("name", MODELS)
def test_chunked_loss_learns_what_the_whole_logits_learn(tmp_path, name):
    ref, _ = _train(tmp_path, MODELS[name])
    got, record = _train(tmp_path, MODELS[name], chunked_loss=True)
    assert record["chunked_loss"] is True
    _assert_same(got, ref, f"{name} chunked")


@pytest.mark.parametrize("ac", ["none", "selective", "full"])
def test_activation_offload_learns_the_same_and_moves_the_bytes_back(tmp_path, ac):
    ref, _ = _train(tmp_path, TINY_LLAMA, ac=ac)
    got, record = _train(tmp_path, TINY_LLAMA, ac=ac, offload_activations=True)
    _assert_same(got, ref, f"offload ({ac} checkpointing)")
    # whatever left came back, and it was not nothing
    assert record["offloaded_bytes"] == record["restored_bytes"] > 0


def test_under_full_checkpointing_the_offload_moves_the_layer_inputs_only(tmp_path):
    """Per micro-batch each layer saves its inputs: hidden states (2 x 16 x 32 fp32) and the
    rotary cos and sin (1 x 16 x 8 fp32 each; 512 bytes, under the 1 KiB floor: kept)."""
    _, record = _train(tmp_path, TINY_LLAMA, ac="full", offload_activations=True)
    hidden_bytes = 2 * SEQ * TINY_LLAMA["hidden_size"] * 4
    num_layers, num_micro = TINY_LLAMA["num_hidden_layers"], 2
    assert record["offloaded_bytes"] == num_layers * num_micro * hidden_bytes
    assert record["restored_bytes"] == record["offloaded_bytes"]


def test_checkpointing_3_of_4_layers_learns_what_none_learns_and_saves_3_inputs(tmp_path):
    """memory.checkpointed_layers=3 under selective: the losses of no checkpointing, and the
    offloaded bytes are 3 layers' inputs and 1 layer's saved tensors: 3/4 of what full
    checkpointing offloads plus 1/4 of what none does (the 4 layers save alike)."""
    deep = {**TINY_LLAMA, "num_hidden_layers": 4}
    ref, none = _train(tmp_path, deep, offload_activations=True)
    got, _ = _train(tmp_path, deep, ac="selective", checkpointed=3)
    _assert_same(got, ref, "3 of 4 layers checkpointed")
    _, three = _train(tmp_path, deep, ac="selective", checkpointed=3, offload_activations=True)
    _, full = _train(tmp_path, deep, ac="full", offload_activations=True)
    offloaded = [r["offloaded_bytes"] for r in (none, three, full)]
    assert offloaded[1] * 4 == 3 * offloaded[2] + offloaded[0], offloaded


def test_op_level_checkpointing_learns_what_none_learns(tmp_path):
    """memory.selective=ops: every layer checkpointed, its matmuls' and attention's outputs
    saved (torchtitan's op policy), the rest recomputed: the losses of no checkpointing."""
    deep = {**TINY_LLAMA, "num_hidden_layers": 4}
    ref, none = _train(tmp_path, deep)
    got, ops = _train(tmp_path, deep, ac="selective", selective="ops")
    _assert_same(got, ref, "op-level checkpointing")
    # each of the 4 layers x 2 micro-batches runs again in backward: at op level 3 projections
    # (k, o and up: the others' outputs were kept); under full checkpointing 6 (the recompute
    # stops before down, whose output backward does not need)
    _, full = _train(tmp_path, deep, ac="full")
    calls = 4 * 2
    assert ops["matmuls"] - none["matmuls"] == 3 * calls, (none, ops)
    assert full["matmuls"] - none["matmuls"] == 6 * calls, (none, full)


def test_both_levers_with_full_checkpointing_learn_the_same(tmp_path):
    ref, _ = _train(tmp_path, GEMMA2)
    got, record = _train(tmp_path, GEMMA2, ac="full", chunked_loss=True, offload_activations=True)
    assert record["chunked_loss"] and record["offload_activations"]
    _assert_same(got, ref, "chunked + offload + full")


def test_a_model_whose_head_cannot_be_chunked_runs_without_it(tmp_path):
    """An output layer that is not a plain nn.Linear: chunked loss off is fine (the back-off
    skips it), forced on is one config error naming the key."""
    from trainer.core.config import ConfigError, ModelConfig
    from trainer.model.build import apply_activation_checkpointing

    model = HFModelFactory(ModelConfig(config=TINY_LLAMA), seed=0).build(CPU)
    apply_activation_checkpointing(model, "none")
    model.lm_head = torch.nn.Sequential(model.lm_head)
    levers = MemoryLevers(model, CPU, chunked_loss=False, offload_activations=False)
    assert levers.next_off() == "offload_activations"
    with pytest.raises(ConfigError, match="memory.chunked_loss: its output layer is a Sequential"):
        MemoryLevers(model, CPU, chunked_loss=True, offload_activations=False)


def test_backward_finds_the_next_layer_already_brought_back():
    """The copies back run one layer ahead of backward (on CUDA they overlap its compute): when
    backward first needs a tensor of layer k, layer k-1's are already on their way, for every
    layer, not only the top one."""
    from trainer.core.config import ModelConfig
    from trainer.loss import compute_loss
    from trainer.memory.offload import ActivationOffload
    from trainer.model.build import apply_activation_checkpointing, set_offload_activations

    config = {**TINY_LLAMA, "num_hidden_layers": 4}
    model = HFModelFactory(ModelConfig(config=config), seed=0).build(CPU)
    apply_activation_checkpointing(model, "none")
    offload = ActivationOffload(CPU)
    set_offload_activations(model, offload)
    back, late = set(), []
    bring_back_one, unpack = offload._bring_back_one, offload._unpack

    def recorded_bring_back(saved):
        back.add(saved.layer)
        bring_back_one(saved)

    def recorded_unpack(saved):
        tensor = unpack(saved)
        if not isinstance(saved, torch.Tensor) and saved.layer - 1 not in back | {-1}:
            late.append(saved.layer)  # layer k needed, layer k-1 still on the host
        return tensor

    offload._bring_back_one, offload._unpack = recorded_bring_back, recorded_unpack
    ids = torch.randint(0, config["vocab_size"], (2, SEQ))
    loss = compute_loss(model, {"input_ids": ids, "labels": ids})
    loss.backward()
    assert back == {0, 1, 2, 3} and not late
