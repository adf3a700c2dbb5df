"""Stopping training on a signal: SIGTERM (a spot or preemptible VM's notice, a scheduler's stop,
`kill`) or SIGINT (Ctrl-C) asks the loop to finish the step in flight, checkpoint that step and
stop, so a resumed run loses nothing; without it the process dies with every step since the last
periodic checkpoint. Google Cloud powers a preempted VM off about 30 s after its SIGTERM.

The handlers are this module's only while `stop_on_signals` is open (the train loop), and the
ones there before come back after: elsewhere the signals do what they did (Prefect's flow engine
turns SIGTERM into a crashed run, Python's SIGINT into KeyboardInterrupt). A second signal while
the checkpoint is written goes to those handlers at once: two Ctrl-Cs stop without saving.

In a multi-process job every process must stop at the same step, or the others would wait in the
step's collectives for one that is gone. A notice may reach one host only, or each at a different
step, so every step the processes agree through the job's coordination service whether any of
them was signalled (`jaxtune.host.processes.any_of`); that costs two small requests to the coordinator
per step and no device work. JAX's own preemption notifier cannot be used: it listens for SIGTERM
through a C handler that Prefect's flow engine replaces with its own.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator

from jaxtune.errors import TrainingStopped
from jaxtune.host import processes

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequests:
    """What the train loop asks after each step: was a stop signalled, and is a timed checkpoint due."""

    def __init__(self, checkpoint_minutes: float | None):
        self.signal: str | None = None  # the first signal's name, once one arrived
        self.interval = checkpoint_minutes * 60 if checkpoint_minutes else None
        self.last_save = time.monotonic()
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        try:
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self.handle)
        except ValueError:  # not the main thread
            pass

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)

    def handle(self, signum: int, frame) -> None:
        if self.signal is None:
            self.signal = signal.Signals(signum).name
            return
        # The second signal: what would have happened without this module, now.
        previous = self._previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    def after_step(self) -> tuple[bool, bool]:
        """(stop now, save a checkpoint for time's sake), the same on every process of the job."""
        due = self.interval is not None and time.monotonic() - self.last_save >= self.interval
        stop = self.signal is not None
        if processes.count > 1:
            stop, due = processes.any_of(stop, due)
            if stop and self.signal is None:
                self.signal = "another process's signal"
        return stop, due

    def saved(self) -> None:
        self.last_save = time.monotonic()

    def stopped(self, step: int, checkpoint: str | None) -> TrainingStopped:
        saved = (
            f"checkpoint saved ({checkpoint}); run again to resume" if checkpoint else "no checkpoint folder to save to"
        )
        return TrainingStopped(f"stopped by {self.signal} at step {step}; {saved}", signal=self.signal, step=step)


@contextlib.contextmanager
def stop_on_signals(checkpoint_minutes: float | None) -> Iterator[StopRequests]:
    """`StopRequests` whose handlers take SIGTERM and SIGINT for the block (in the main thread;
    elsewhere Python cannot install handlers, and the signals keep theirs)."""
    requests = StopRequests(checkpoint_minutes)
    requests.install()
    try:
        yield requests
    finally:
        requests.restore()
