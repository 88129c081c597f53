"""torchrun's own report of failed workers goes to run.dir/torchrun.log; the workers' lines, their
own tracebacks included, reach the user unchanged."""

from __future__ import annotations

import io

from launcher.run.torchrun_output import TorchrunOutput

WORKER = """\
[rank0] step 1/4 | loss 3.7893 | lr 3.00e-03 | gnorm 3.105 | 7,074 tok/s | eta 0:00:00
[rank0] out of memory at step 2 on ddp in forward at micro-batch 1: wrote oom-report.json (exit 75)
"""
CRASH = """\
Traceback (most recent call last):
  File "/work/trainer/engine.py", line 10, in run_training
    return _train(run)
ValueError: a real bug in a worker
"""
AGENT = """\
W1123 18:58:27.342000 21970 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 21984 closing signal SIGTERM
E1123 18:58:27.360000 21970 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 75) local_rank: 0 (pid: 21983) of binary: python3
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
trainer FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-23_18:58:27
  rank      : 1 (local_rank: 1)
  exitcode  : 75 (pid: 21984) 
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 75 (pid: 21983) 
============================================================
"""  # noqa: E501, W291


def test_the_report_goes_to_the_log_and_worker_lines_pass(tmp_path):
    out = io.StringIO()
    filt = TorchrunOutput(tmp_path / "torchrun.log", out)
    after = "[rank0] a line after the report\n"
    for line in io.StringIO(WORKER + CRASH + AGENT + after):
        filt.feed(line)
    filt.close()
    assert out.getvalue() == WORKER + CRASH + after
    assert (tmp_path / "torchrun.log").read_text() == AGENT
    assert filt.num_diverted == len(AGENT.splitlines())


def test_a_traceback_cut_short_is_shown(tmp_path):
    out = io.StringIO()
    filt = TorchrunOutput(tmp_path / "torchrun.log", out)
    text = 'Traceback (most recent call last):\n  File "x.py", line 1\n'
    for line in io.StringIO(text):
        filt.feed(line)
    filt.close()
    assert out.getvalue() == text and not (tmp_path / "torchrun.log").exists()


def test_the_ranks_config_error_is_kept_once_and_a_full_log_does_not_stop_the_output(tmp_path):
    """Every rank prints its one line for bad input: the supervisor says it once. A run.dir
    with no room for torchrun.log (here: a directory in its place) loses the log lines only."""
    out = io.StringIO()
    log = tmp_path / "torchrun.log"
    log.mkdir()
    filt = TorchrunOutput(log, out)
    line = "config error: run.dir: could not write checkpoint step_4 to X: No space left\n"
    # torchrun stops rank 1 once rank 0 exits on the bad input: its notice is not news either
    stopped = "[rank1] received SIGTERM: stopping after this step\n"
    for text in io.StringIO(WORKER + line + stopped + line + AGENT):
        filt.feed(text)
    filt.close()
    assert out.getvalue() == WORKER
    assert filt.config_error == line.strip()


STOPPED = """\
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 936, in main
    run(args)
  File "/venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py", line 84, in _terminate_process_handler
    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)
torch.distributed.elastic.multiprocessing.api.SignalException: Process 4242 got signal: 15
"""  # noqa: E501


def test_torchruns_own_traceback_on_a_stop_signal_goes_to_the_log(tmp_path):
    """A SIGTERM of a multi-rank run: the ranks checkpoint and say so; torchrun's traceback of
    the signal that reached it is not the user's to read."""
    out = io.StringIO()
    filt = TorchrunOutput(tmp_path / "torchrun.log", out)
    for line in io.StringIO(WORKER + STOPPED):
        filt.feed(line)
    filt.close()
    assert out.getvalue() == WORKER
    assert (tmp_path / "torchrun.log").read_text() == STOPPED


PEER_LOST = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "/work/trainer/runtime/dist.py", line 192, in all_reduce_max_many
[rank0]:     dist.all_reduce(t, op=dist.ReduceOp.MAX)
[rank0]: RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:54939: Connection reset by peer. This is typically caused by a remote worker hanging
"""  # noqa: E501
KILLED = """\
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
trainer FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-26_13:42:31
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 27535)  (SIGTERM)
  traceback : Signal 15 (SIGTERM) received by PID 27535
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-26_13:42:31
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 27536)  (SIGKILL)
  traceback : Signal 9 (SIGKILL) received by PID 27536
============================================================
"""  # noqa: E501, W291


def test_a_killed_rank_is_named_and_the_others_lost_peer_tracebacks_go_to_the_log(tmp_path):
    """kill -9 of rank 1: rank 0's gloo traceback (it lost its peer) and torchrun's report go to
    the log; the filter names the killed rank for the supervisor's one line."""
    out = io.StringIO()
    filt = TorchrunOutput(tmp_path / "torchrun.log", out)
    for line in io.StringIO(WORKER + PEER_LOST + KILLED):
        filt.feed(line)
    filt.close()
    assert out.getvalue() == WORKER
    assert filt.killed == {1: "SIGKILL"}
    assert (tmp_path / "torchrun.log").read_text() == PEER_LOST + KILLED
