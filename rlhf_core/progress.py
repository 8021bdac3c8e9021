"""Progress bars of the library's slow loops (pairs scored, replies judged, prompts answered, steps trained).

A bar is a tqdm bar on stderr with a rate and an estimate of the time left, shown only to a person
watching a terminal: when stderr is not a terminal (test logs, CI, a Prefect worker's log) or when
RLHF_QUIET is set to anything but "" or "0", it draws nothing, so logs stay clean. Whatever is drawn,
`Progress.advance` also calls the caller's `on_advance(done, total)`: how a test follows a loop, and how
a caller mirrors it elsewhere (a Prefect progress artifact).
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr

from tqdm.auto import tqdm

QUIET_ENV = "RLHF_QUIET"

ProgressCallback = Callable[[int, int], None]  # (done, total)


def bars_enabled() -> bool:
    """Whether progress bars are drawn: stderr is a terminal and RLHF_QUIET is unset (or "0")."""
    return sys.stderr.isatty() and os.environ.get(QUIET_ENV, "") in ("", "0")


class Progress:
    """Counts work done out of `total`, drawing a bar when `bars_enabled()` and reporting to `on_advance`."""

    def __init__(self, total: int, desc: str, unit: str, on_advance: ProgressCallback | None = None) -> None:
        self.total = total
        self.done = 0
        self.on_advance = on_advance
        self.bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not bars_enabled())

    def advance(self, count: int = 1) -> None:
        """`count` more units done."""
        self.done += count
        self.bar.update(count)
        if self.on_advance is not None:
            self.on_advance(self.done, self.total)

    def close(self) -> None:
        self.bar.close()


@contextmanager
def progress(total: int, desc: str, unit: str, on_advance: ProgressCallback | None = None) -> Iterator[Progress]:
    """A `Progress` over `total` units, its bar closed on exit."""
    tracker = Progress(total, desc, unit, on_advance)
    try:
        yield tracker
    finally:
        tracker.close()


@contextmanager
def unswitchable_bars_hidden() -> Iterator[None]:
    """While the block runs, hold what is written to sys.stderr unless `bars_enabled()`: for a library bar
    that has no switch of its own (transformers' GGUF conversion draws a plain tqdm bar). What was held is
    written out after all if the block raises, so no message that explains a failure is lost."""
    if bars_enabled():
        yield
        return
    held = io.StringIO()
    try:
        with redirect_stderr(held):
            yield
    except BaseException:
        sys.stderr.write(held.getvalue())
        raise
