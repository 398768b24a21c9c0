"""SIGTERM (a pre-empted job) and SIGINT (Ctrl-C) during a run.

While the training loop runs (`StopSignals.deferred()`), a signal only asks to stop: the loop finishes the
optimizer step it is in, saves a checkpoint `step-<n>` (and a training state when states are saved), and the
command exits with 143 (SIGTERM) or 130 (SIGINT). A further signal while that happens is ignored, so the
save completes. Outside the loop (loading models, stage 1) a signal stops at once, as an exception, so the
output folder's lock is still released; what was written there is crash-safe anyway.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Terminated(BaseException):
    """SIGTERM outside the training loop (a BaseException, like KeyboardInterrupt: nothing swallows it)."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.signum, 128 + self.signum)


def _say(text: str) -> None:
    # os.write, not print: a handler may run in the middle of another print
    try:
        os.write(2, (text + "\n").encode())
    except OSError:
        pass


class StopSignals:
    """Context manager installing the SIGTERM / SIGINT handlers for a run (main thread only; else a no-op)."""

    def __init__(self, verbose: bool = True):
        self.signum: int | None = None
        self.verbose = verbose
        self._defer = False
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str | None:
        return signal.Signals(self.signum).name if self.signum else None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in EXIT_CODES:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    @contextmanager
    def deferred(self):
        """Within the block, a signal sets `requested` instead of stopping at once."""
        self._defer = True
        try:
            yield self
        finally:
            self._defer = False

    def _handle(self, signum, frame) -> None:
        if not self._defer:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise Terminated(signum)
        if self.signum is None:
            self.signum = signum
            if self.verbose:
                _say(f"{signal.Signals(signum).name} received: stopping after this optimizer step (a checkpoint is "
                     f"saved first)")
        elif self.verbose:
            _say(f"{signal.Signals(signum).name} received again: ignored while the checkpoint is saved "
                 f"(SIGKILL stops at once, losing it)")
