"""ParallelDims without a process group: where each rank sits, which ranks form a sequence
group, why a split cannot run, and that every size a refusal suggests passes the same check."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trainer.core.errors import ConfigError
from trainer.core.flops import attention_flops_per_token, training_flops_per_token
from trainer.core.parallel_dims import (
    AttentionShape,
    Batch,
    ParallelDims,
    check_sequence_parallel,
    sequence_sizes,
)

LLAMA_8B = AttentionShape(heads=32, kv_heads=8)


def test_ranks_of_a_sequence_group_are_neighbours() -> None:
    dims = ParallelDims(world_size=8, sequence=4)
    assert dims.data == 2
    assert [dims.coordinates(r) for r in (0, 3, 4, 7)] == [(0, 0), (0, 3), (1, 0), (1, 3)]
    assert dims.sequence_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert ParallelDims(3).sequence_groups() == [[0], [1], [2]]


@pytest.mark.parametrize(
    ("dims", "attention", "seq_len", "words"),
    [
        (ParallelDims(4, 3), LLAMA_8B, 4096, "3 does not divide the world of 4 ranks"),
        (ParallelDims(6, 3), AttentionShape(4, 4), 4096, "3 does not divide the model's 4 "),
        (ParallelDims(6, 6), AttentionShape(12, 4), 4096, "6 and the model's 4 key/value"),
        (ParallelDims(2, 2), LLAMA_8B, 63, "2 does not divide data.seq_len=63"),
        (ParallelDims(2, 2), AttentionShape(None), 64, "no attention heads"),
    ],
)
def test_a_split_that_cannot_run_says_why(dims, attention, seq_len, words) -> None:
    problem = dims.problem(attention, seq_len, Batch(global_size=12))
    assert problem is not None and words in problem


def test_fewer_key_value_heads_than_ranks_are_repeated() -> None:
    assert ParallelDims(16, 16).problem(LLAMA_8B, 131072, Batch(global_size=1)) is None


def test_the_data_groups_must_share_the_batch() -> None:
    problem = ParallelDims(8, 2).batch_problem(Batch(global_size=6))
    assert problem == "the 4 data groups (8 ranks / 2) do not divide train.global_batch_size=6"
    micro = ParallelDims(8, 2).batch_problem(Batch(global_size=8, micro=4))
    assert micro is not None and "train.micro_batch_size=4" in micro


def test_every_size_a_refusal_suggests_passes_the_check() -> None:
    attention, batch = AttentionShape(4, 2), Batch(global_size=4)
    with pytest.raises(ConfigError) as err:
        check_sequence_parallel(ParallelDims(4, 3), attention, 64, batch)
    assert "use sequence_parallel=1 or 2 or 4" in str(err.value)
    for sp in sequence_sizes(4, attention, 64, batch):
        check_sequence_parallel(ParallelDims(4, sp), attention, 64, batch)


def test_flops_per_token_count_the_matmuls_and_attention_once() -> None:
    # Llama-3.1-8B at 8k: 6N plus 12 x 32 layers x 4096 hidden x 8192 positions
    assert attention_flops_per_token(32, 4096, 8192) == 12 * 32 * 4096 * 8192
    assert training_flops_per_token(8_030_261_248, 32, 4096, 8192) == pytest.approx(6.106e10, 1e-3)


def test_parallel_dims_and_flops_import_no_torch() -> None:
    code = (
        "import sys, trainer.core.parallel_dims, trainer.core.flops; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
