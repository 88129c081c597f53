"""The hang watchdog's diagnosis (trainer/runtime/hang.py): which ranks did not arrive, and where
the others wait, from the states the ranks report. The watchdog itself, on two real ranks with a
hang injected, restarting and finishing: tests/test_rank_killed.py."""

from __future__ import annotations

from trainer.runtime.hang import RankState, diagnose

GATHER = "all_gather_into_tensor (torch/distributed/distributed_c10d.py:4000)"
REDUCE = "all_reduce (torch/distributed/distributed_c10d.py:3252)"


def _waits(rank: int, step: int, collective: str = GATHER) -> RankState:
    return RankState(rank, step, collective, "all_reduce_sum (trainer/runtime/dist.py:179)")


def _busy(rank: int, step: int | None) -> RankState:
    return RankState(rank, step, None, "forward (trainer/step.py:80)")


def test_the_rank_outside_a_collective_did_not_arrive_where_the_others_wait():
    states = {0: _waits(0, 5), 1: _busy(1, 5), 2: _waits(2, 5), 3: _waits(3, 5)}
    report = diagnose(states, 4, 30)
    assert report["ranks"] == [1] and report["step"] == 5
    assert report["line"] == (
        f"hang at step 5: rank 1 did not arrive at {GATHER} called from all_reduce_sum "
        "(trainer/runtime/dist.py:179), where ranks 0, 2 and 3 wait; "
        "rank 1 is at forward (trainer/step.py:80); limit run.hang_timeout_s=30 s"
    )


def test_a_rank_that_never_answered_is_named_as_such():
    report = diagnose({0: _waits(0, 2), 1: _waits(1, 2)}, 3, 300)
    assert report["ranks"] == [2]
    assert "rank 2 did not arrive at all_gather" in report["line"]
    assert "rank 2 did not answer" in report["line"]


def test_every_rank_in_the_same_collective_blames_none():
    report = diagnose({0: _waits(0, 7), 1: _waits(1, 7)}, 2, 30)
    assert report["ranks"] == []
    assert report["line"].startswith(f"hang at step 7: every rank waits in {GATHER}")


def test_ranks_in_another_collective_at_an_earlier_step_are_the_late_ones():
    states = {0: _waits(0, 7), 1: _waits(1, 6, REDUCE), 2: _waits(2, 7)}
    report = diagnose(states, 3, 30)
    assert report["ranks"] == [1] and report["collective"] == GATHER


def test_many_waiting_ranks_are_counted_not_listed():
    states = {r: _waits(r, 3) for r in range(1, 64)} | {0: _busy(0, 3)}
    line = diagnose(states, 64, 30)["line"]
    assert "rank 0 did not arrive" in line and "where 63 ranks (1..63) wait" in line
