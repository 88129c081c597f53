"""Stop requests: SIGTERM, SIGINT and SIGUSR1 finish the current step, checkpoint, exit 143.

The handler only sets a flag; the engine checks it at every step boundary and all ranks agree
(a max over the flag) so that no rank leaves a collective the others are still in.
"""

from __future__ import annotations

import logging
import signal

import torch

from trainer.contract import EXIT_SIGNAL
from trainer.dist import all_reduce_max, all_reduce_max_many

log = logging.getLogger(__name__)

_HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StopSignals:
    def __init__(self) -> None:
        self.signum = 0
        for sig in _HANDLED:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum:  # asked twice: stop now, without a checkpoint
            raise SystemExit(EXIT_SIGNAL)
        log.warning("received %s: stopping after this step", signal.Signals(signum).name)
        self.signum = signum

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
