"""SIGTERM and SIGINT as a request to stop at the next update boundary."""
from __future__ import annotations

import os
import signal

from absl import logging

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Turns the first SIGTERM or SIGINT into a request to stop at the next update boundary.

    A second one ends the process at once, as if no handler were there.
    """

    def __init__(self):
        self._signal: int | None = None

    def listen(self) -> None:
        """Installs the handlers; call it after the distribution strategy is built.

        A multi-worker strategy starts TF's coordination service, which puts its own
        SIGTERM handler in place of any installed before it: one installed later wins.
        """
        for number in STOP_SIGNALS:
            signal.signal(number, self._record)

    def received(self) -> int | None:
        """The number of the signal that asked the run to stop, or None."""
        return self._signal

    def _record(self, number: int, frame) -> None:
        if self._signal is not None:
            signal.signal(number, signal.SIG_DFL)
            os.kill(os.getpid(), number)
        self._signal = number
        logging.info("%s received: stopping after the current update (again to stop at once)",
                     signal.Signals(number).name)
