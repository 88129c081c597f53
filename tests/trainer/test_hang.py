"""The hang watchdog's diagnosis (trainer/runtime/hang.py): which ranks did not arrive, and where
the others wait, from the states the ranks report. The watchdog itself, on two real ranks with a
hang injected, restarting and finishing: tests/test_rank_killed.py."""

from __future__ import annotations

import pytest

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


VICTIM = b"a file outside run.dir: never written\n"


def test_stacks_replace_a_planted_link_and_a_linked_hang_dir_is_refused(tmp_path):
    """run.dir/hang/rank0.txt planted as a link to a file outside run.dir: the stacks replace
    the link, the file keeps its bytes; a hang/ that is itself a link is refused."""
    from tests.conftest import write_demo_job
    from trainer.core.config import ConfigError, load_config
    from trainer.runtime.hang import HangWatchdog

    cfg = load_config(write_demo_job(tmp_path / "job.yaml"))
    victim = tmp_path / "victim.txt"
    victim.write_bytes(VICTIM)
    run = tmp_path / "run"
    (run / "hang").mkdir(parents=True)
    (run / "hang" / "rank0.txt").symlink_to(victim)
    watchdog = HangWatchdog(cfg, run, rank=0, world_size=1)
    try:
        path = watchdog.dump_stacks(_busy(0, 3))
        assert path == run / "hang" / "rank0.txt" and not path.is_symlink()
        text = path.read_text()
        assert text.startswith("# oomless hang watchdog: rank 0 (step 3, at forward")
        assert "test_stacks_replace_a_planted_link" in text  # this thread's own frame
        assert victim.read_bytes() == VICTIM

        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        linked = tmp_path / "linked"
        linked.mkdir()
        (linked / "hang").symlink_to(elsewhere)
        watchdog.run_dir = linked
        with pytest.raises(ConfigError, match="hang: is a symbolic link") as err:
            watchdog.dump_stacks(_busy(0, 3))
        assert "\n" not in str(err.value)
        assert list(elsewhere.iterdir()) == []
    finally:
        watchdog.close()


def test_latest_is_replaced_through_a_fresh_name_never_a_planted_one(tmp_path):
    from trainer.checkpoint.store import write_latest

    victim = tmp_path / "victim.txt"
    victim.write_bytes(VICTIM)
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    (root / "latest.tmp").symlink_to(victim)  # the name the old code wrote through
    (root / "latest").symlink_to(victim)
    write_latest(root, "step_4", lambda what: None)
    assert (root / "latest").read_text() == "step_4\n" and not (root / "latest").is_symlink()
    assert victim.read_bytes() == VICTIM


def test_auto_fires_before_torch_s_collective_timeout(tmp_path):
    """`auto` waits 10 x the slowest step and at least 300 s, or half of dist.timeout_s when that
    is shorter: with dist.timeout_s=5 the floor of 300 s let torch's timeout end every hang."""
    from tests.conftest import write_demo_job
    from trainer.core.config import load_config
    from trainer.runtime.hang import HangWatchdog

    for timeout_s, floor_s in ((5, 2.5), (600, 300.0), (120, 60.0)):
        cfg = load_config(write_demo_job(tmp_path / "job.yaml", dist={"timeout_s": timeout_s}))
        watchdog = HangWatchdog(cfg, tmp_path / "run", rank=0, world_size=1)
        try:
            assert watchdog.limit_s() is None  # auto: armed after the first step
            watchdog.started(0)
            watchdog.finished()  # a step of a few microseconds
            assert watchdog.limit_s() == floor_s
            watchdog.slowest_s = 1.0
            assert watchdog.limit_s() == max(floor_s, 10.0)
        finally:
            watchdog.close()
