"""What the user sees when things go wrong: exit codes, one-line errors without tracebacks,
messages on stderr, and the signals that ask a run to stop."""

import signal
import sys
from contextlib import contextmanager

EXIT_OK, EXIT_ROW_ERRORS = 0, 3  # all rows done; done, some rows in the error file
EXIT_INTERRUPTED = 75  # a stop signal came: the run is resumable (EX_TEMPFAIL)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)  # SIGUSR1: SLURM's preemption notice


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Stopped(Exception):
    """A stop signal came while the run was waiting (on its input, on a model load)."""


class StopSignals:
    """While active, SIGTERM, SIGINT and SIGUSR1 (SLURM's preemption notice) do not kill the
    process: they are recorded in `received` (a run stops between two decode steps, dropping
    the batch in flight, which the rerun redoes) and handed to `forward`, if given. Inside
    `waiting()`, where nothing is being written, a stop raises Stopped at once instead: a read
    blocked on a FIFO or stdin would otherwise resume and wait on."""

    def __init__(self, forward=None):
        self.received: int | None = None
        self.forward = forward
        self.raising = False

    def __enter__(self):
        self.previous = {s: signal.signal(s, self.handle) for s in STOP_SIGNALS}
        return self

    def take_back(self) -> None:
        """Handle the stop signals again after a library installed its own (Ray's core worker)."""
        for s in STOP_SIGNALS:
            signal.signal(s, self.handle)

    def handle(self, signum, frame):
        self.received = signum
        if self.forward:
            self.forward(signum)
        if self.raising:
            self.raising = False
            raise Stopped(signal.Signals(signum).name)

    @contextmanager
    def waiting(self):
        """A stretch that a stop signal may cut short (with Stopped), one that came before included."""
        if self.received:
            raise Stopped(signal.Signals(self.received).name)
        self.raising = True
        try:
            yield
        finally:
            self.raising = False

    def each(self, items):
        """The items, each waited for inside waiting()."""
        items = iter(items)
        while True:
            with self.waiting():
                item = next(items, None)
            if item is None:
                return
            yield item

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


class UserError(Exception):
    """Something the user can fix that is not an option problem (exit 1)."""

    exit_code = 1


class UsageError(UserError):
    """Options that cannot work together, or name something that is not there (exit 2)."""

    exit_code = 2


def first_line(error: BaseException) -> str:
    """An exception's message, first line only (library errors can span pages)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
