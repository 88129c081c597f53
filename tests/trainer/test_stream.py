"""The `stream` rung's refusals: what it does not take is one line naming the rungs that do.
(Its parity with `single` is in tests/trainer/test_distributed.py's shared runs.)"""

from __future__ import annotations

import pytest

from tests.conftest import TINY_LLAMA, oomless, write_demo_job
from trainer.core.config import ConfigError, load_config


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["finetune.method=qlora", "precision=bf16"], "stream cannot run qlora"),
        (["train.optimizer=adamw_8bit"], "stream cannot run adamw_8bit"),
        (["train.optimizer_in_backward=true", "train.global_batch_size=8",
          "train.micro_batch_size=8", "train.grad_clip=0"],
         "stream cannot run optimizer_in_backward"),
    ],
)  # fmt: skip
def test_what_stream_does_not_take_is_one_line_naming_the_rungs_that_do(tmp_path, overrides, words):
    job = write_demo_job(tmp_path / "job.yaml", model={"config": {**TINY_LLAMA, "vocab_size": 45}})
    with pytest.raises(ConfigError) as err:
        load_config(job, ["strategy=stream", *overrides])
    line = str(err.value)
    assert "\n" not in line and line.startswith("config error: strategy:"), line
    assert words in line and "use one of single" in line, line


def test_lora_on_stream_exits_2_in_one_line(tmp_path):
    job = write_demo_job(tmp_path / "job.yaml")
    r = oomless("config", str(job), "strategy=stream", "finetune.method=lora")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "stream cannot run lora" in r.stderr and "use one of single" in r.stderr, r.stderr


@pytest.mark.parametrize("delay", [None, 0.02])
def test_what_the_backend_holds_on_the_device_stays_within_the_estimate(tmp_path, delay):
    """Two micro-batches and a step of the stream backend in this process: its own count of
    device bytes (buffers, resident parts, kept inputs, gradients on their way out) never
    exceeds the estimate's peak tensor bytes nor what it keeps plus two layers' gradients, and
    at rest it is the estimate's `params`; also with every copy slowed (`delay`), as on a loaded
    machine, where the resident parts' gradients once left after two layers' still leaving."""
    import torch

    from launcher.estimate.peak import estimate
    from launcher.estimate.shape import model_shape
    from launcher.plan.hardware import detect_hardware
    from launcher.plan.ladder import job_step
    from trainer.backends import BackendContext, OptimizerSpec, build_backend
    from trainer.core import strategies
    from trainer.model.build import HFModelFactory
    from trainer.step import micro_batch_loss

    train = {"global_batch_size": 8, "micro_batch_size": 4}
    job = write_demo_job(tmp_path / "job.yaml", train=train)
    cfg = load_config(job, ["strategy=stream", f"debug.stream_copy_delay_s={delay}"] if delay
                      else ["strategy=stream"])  # fmt: skip
    micro, seq = 4, cfg.data.seq_len
    spec = job_step(cfg, detect_hardware(cfg.hardware), strategies.row("stream"), micro, "full")
    est = estimate(model_shape(cfg.model), spec)
    ctx = BackendContext(cfg=cfg, device=torch.device("cpu"), rank=0, local_rank=0, world_size=1,
                         precision="fp32", activation_checkpointing="full",
                         micro_batch_size=micro, grad_accum=2)  # fmt: skip
    backend = build_backend("stream", ctx)
    model = backend.setup(HFModelFactory(cfg.model, 0),
                          OptimizerSpec(1e-3, (0.9, 0.95), 1e-8, 0.0, 1.0))  # fmt: skip
    assert backend.ledger.held == est.device_breakdown["params"]
    ids = torch.randint(3, 45, (micro, seq))
    for _ in range(2):
        loss = micro_batch_loss(model, backend, {"input_ids": ids, "labels": ids})
        backend.backward(loss / ids.numel())
    backend.step()
    backend.host.finish_step()
    assert 0 < backend.ledger.peak <= est.peak_tensor_bytes, (backend.ledger.peak, est.phases)
    layer_bytes = 4 * backend.streamer.numel  # fp32
    kept = len(backend.streamer.units) * ids.numel() * model.config.hidden_size * 4
    resident_grads = 4 * sum(p.numel() for _, p in backend.resident)
    in_flight = max(2 * layer_bytes, layer_bytes + resident_grads)
    assert backend.ledger.peak <= est.device_breakdown["params"] + kept + in_flight
    print(f"stream holds {backend.ledger.peak} of {est.peak_tensor_bytes} estimated")
    assert backend.ledger.held == est.device_breakdown["params"]


@pytest.mark.parametrize("staging_numel", [4, 5, 17, 100])
def test_gradients_larger_than_the_staging_buffer_land_whole(staging_numel):
    """The pinned staging buffer holds one layer; the resident parts' gradients (embeddings and
    head, larger than a layer for every large vocabulary) go through it a fill at a time, and
    every piece lands at its place in the host's fp32 gradients."""
    import torch

    from trainer.streaming.layers import copy_out

    pieces = [torch.randn(n).to(torch.bfloat16) for n in (5, 3, 9)]
    grad = torch.randn(20)
    want = grad.clone()
    want[:17] += torch.cat(pieces).float()
    copy_out(list(pieces), grad, torch.empty(staging_numel, dtype=torch.bfloat16))
    assert torch.equal(grad, want)
