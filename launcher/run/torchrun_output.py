"""torchrun's own output, kept out of the run's: its agent's log lines and the ChildFailedError
report it prints when a worker fails (a traceback of torchrun itself, then "trainer FAILED",
"Root Cause", each rank's exit code: about 25 lines), its SignalException traceback when a
stop signal reaches it, and the tracebacks of ranks that lost a peer mid-collective (a rank that
was killed: the supervisor names it in one line) go to run.dir/torchrun.log. The workers' other
lines, their own tracebacks included, pass through unchanged.

An out-of-memory exit that the supervisor escalates is then one line from the rank that ran out
and one from the supervisor saying what comes next, not a crash report. The ranks' one line for
bad input ("config error: ...", every rank says it) goes to the log too, and the supervisor says it
once; so do the other ranks' notices that torchrun's stop signal reached them after it.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import IO

from trainer.core.files import append_line
from trainer.core.logs import redact

# torch.distributed.elastic logs glog-style: "E1123 18:58:27.360000 21970 .../api.py:1002] ..."
_AGENT_LINE = re.compile(r"^[EWID]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S*torch/distributed/")
_RULE = "=" * 20
_CONFIG_ERROR = "config error: "  # a rank's one line before exit 2 (trainer/__main__.py)
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ")
# gloo's words for a peer that went away mid-collective
_PEER_LOST = re.compile(r"Connection (reset|closed) by peer")
# a rank's notice that a stop signal reached it (trainer/runtime/signals.py)
_STOP_NOTICE = re.compile(r"^(\[rank\d+\] )?received SIG\w+: stopping after this step")


class TorchrunOutput:
    """Copies torchrun's stderr line by line to `out`, diverting torchrun's own lines to `log`."""

    def __init__(self, log_path: Path, out: IO[str]):
        self.log_path = log_path
        self.out = out
        self.num_diverted = 0
        self.config_error: str | None = None  # the first rank's one line for bad input
        self._held: list[str] = []  # a traceback whose exception line has not come yet
        self._rules_left = 0  # inside the ChildFailedError report: closing rules still to come
        self._report_rank: int | None = None
        self.killed: dict[int, str] = {}  # rank -> the signal that ended it (SIGKILL, ...)

    def feed(self, line: str) -> None:
        line = redact(line)  # a worker's traceback can quote a URI with its password
        body = _RANK_PREFIX.sub("", line)  # a worker's uncaught error comes as "[rankN]: ..."
        if self._rules_left:
            self._divert(line)
            self._read_report(line)
            if line.startswith(_RULE):
                self._rules_left -= 1
        elif self._held:
            self._held.append(line)
            if not body.startswith((" ", "\t")):  # the exception line ends a traceback
                held, self._held = self._held, []
                if "ChildFailedError" in line:  # torchrun's report follows between two rules
                    for h in held:
                        self._divert(h)
                    self._rules_left = 2
                elif "SignalException" in line or _PEER_LOST.search(line):
                    # torchrun itself stopped by a signal; or a rank that lost a peer (the
                    # peer's end is the news: the supervisor names it)
                    for h in held:
                        self._divert(h)
                else:  # a worker's own traceback: the user's to see
                    self._write(held)
        elif body.startswith("Traceback (most recent call last):"):
            self._held = [line]
        elif _AGENT_LINE.match(line):
            self._divert(line)
        elif line.startswith(_CONFIG_ERROR):  # every rank says it: the supervisor says it once
            self.config_error = self.config_error or line.strip()
            self._divert(line)
        elif self.config_error and _STOP_NOTICE.match(body):
            # torchrun stops the other ranks after one exits on bad input: not news to the user
            self._divert(line)
        else:
            self._write([line])

    def _read_report(self, line: str) -> None:
        """The ranks that a signal ended, from torchrun's report ("rank : 1 ...", then
        "exitcode : -9 (pid: N)  (SIGKILL)")."""
        if m := re.match(r"\s*rank\s*: (\d+)", line):
            self._report_rank = int(m.group(1))
        elif (m := re.match(r"\s*exitcode\s*: -\d+ .*\((SIG\w+)\)", line)) and (
            self._report_rank is not None and m.group(1) not in ("SIGTERM", "SIGINT")
        ):  # a stop's SIGTERM of the others is torchrun's doing, not news
            self.killed[self._report_rank] = m.group(1)

    def close(self) -> None:
        if self._held:
            self._write(self._held)
            self._held = []

    def pump(self, stream: IO[str]) -> threading.Thread:
        """Feed every line of `stream` from a thread; returns it (join it after the process)."""

        def run() -> None:
            for line in stream:
                self.feed(line)
            self.close()

        thread = threading.Thread(target=run, name="torchrun-output", daemon=True)
        thread.start()
        return thread

    def _write(self, lines: list[str]) -> None:
        self.out.write("".join(lines))
        self.out.flush()

    def _divert(self, line: str) -> None:
        self.num_diverted += 1
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            append_line(self.log_path, line.rstrip("\n"), durable=False)  # never through a link
        except OSError:  # a full or read-only run.dir: the line is lost, the workers go on
            pass
