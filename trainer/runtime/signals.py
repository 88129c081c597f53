"""Stop requests: SIGTERM, SIGINT and SIGUSR1 finish the current step, checkpoint, exit 143.

The handler only sets a flag; the engine checks it at every step boundary and all ranks agree
(a max over the flag) so that no rank leaves a collective the others are still in.

Exit 143 promises a checkpoint, so a second signal (an impatient Ctrl-C, Slurm's SIGTERM after its
SIGUSR1) does not cut the stop checkpoint short: it is logged and the checkpoint is finished. A
third stops at once with exit 130 (EXIT_CUT_OFF): no checkpoint of this step; resume from the
previous one.
"""

from __future__ import annotations

import logging
import signal

import torch

from trainer.core.contract import EXIT_CUT_OFF, EXIT_SIGNAL
from trainer.runtime.dist import all_reduce_max, all_reduce_max_many

log = logging.getLogger(__name__)

_HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StopSignals:
    def __init__(self) -> None:
        self.signum = 0
        self.num_received = 0
        for sig in _HANDLED:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.num_received += 1
        name = signal.Signals(signum).name
        if self.num_received == 1:
            log.warning("received %s: stopping after this step", name)
            self.signum = signum
        elif self.num_received == 2:
            log.warning(
                "received %s again: still finishing this step and its checkpoint (exit %d); "
                "a third signal stops at once without it (exit %d)",
                name,
                EXIT_SIGNAL,
                EXIT_CUT_OFF,
            )
        else:
            log.error(
                "received %s a third time: stopping now; this step has no checkpoint, resume "
                "from the previous one (exit %d)",
                name,
                EXIT_CUT_OFF,
            )
            raise SystemExit(EXIT_CUT_OFF)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "a signal on another rank"

    def agreed(self, device: torch.device) -> bool:
        """True on every rank once any rank has received a stop signal."""
        return all_reduce_max(float(self.signum), device) > 0

    def agreed_with(self, value: float, device: torch.device) -> tuple[bool, float]:
        """(stop agreed, max of `value` over ranks): both in one collective."""
        signum, value = all_reduce_max_many([float(self.signum), value], device)
        return signum > 0, value
