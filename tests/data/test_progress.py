"""rlhf_core/progress.py: bars only for a person at a terminal, the caller's callback always."""

from __future__ import annotations

import io
import sys

import pytest
from tqdm.auto import tqdm

from rlhf_core import progress as progress_module
from rlhf_core.progress import QUIET_ENV, bars_enabled, progress, unswitchable_bars_hidden


class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_bars_show_only_on_a_terminal_and_not_when_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(QUIET_ENV, raising=False)
    monkeypatch.setattr(progress_module.sys, "stderr", io.StringIO())
    assert not bars_enabled()  # a log file, a pipe, pytest's capture
    monkeypatch.setattr(progress_module.sys, "stderr", Terminal())
    assert bars_enabled()
    monkeypatch.setenv(QUIET_ENV, "1")
    assert not bars_enabled()
    monkeypatch.setenv(QUIET_ENV, "0")
    assert bars_enabled()


def test_a_bar_draws_on_a_terminal_with_an_estimate_and_reports_to_the_callback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(QUIET_ENV, raising=False)
    terminal = Terminal()
    monkeypatch.setattr(progress_module.sys, "stderr", terminal)
    reported: list[tuple[int, int]] = []
    with progress(10, "score-pairs", "pair", lambda done, total: reported.append((done, total))) as tracker:
        for _ in range(5):
            tracker.advance(2)
    assert reported == [(2, 10), (4, 10), (6, 10), (8, 10), (10, 10)]
    drawn = terminal.getvalue()
    assert "score-pairs" in drawn and "10/10" in drawn and "<" in drawn  # tqdm's "elapsed<remaining"


def test_quiet_draws_nothing_but_still_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = Terminal()
    monkeypatch.setattr(progress_module.sys, "stderr", terminal)
    monkeypatch.setenv(QUIET_ENV, "1")
    reported: list[tuple[int, int]] = []
    with progress(3, "eval", "prompt", lambda done, total: reported.append((done, total))) as tracker:
        tracker.advance(3)
    assert reported == [(3, 3)] and terminal.getvalue() == ""


def library_bar() -> None:
    """A library's bar with no switch of its own: plain tqdm on whatever sys.stderr is."""
    for _ in tqdm(range(3), desc="de-quantizing"):
        pass


def test_an_unswitchable_library_bar_is_hidden_unless_someone_watches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(QUIET_ENV, raising=False)
    log_file = io.StringIO()
    monkeypatch.setattr(progress_module.sys, "stderr", log_file)
    with unswitchable_bars_hidden():
        library_bar()
    assert log_file.getvalue() == ""
    terminal = Terminal()
    monkeypatch.setattr(progress_module.sys, "stderr", terminal)
    with unswitchable_bars_hidden():
        library_bar()
    assert "de-quantizing" in terminal.getvalue()


def test_what_a_failing_block_wrote_is_not_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(QUIET_ENV, "1")
    log_file = io.StringIO()
    monkeypatch.setattr(progress_module.sys, "stderr", log_file)
    with pytest.raises(ValueError, match="bad tensor"), unswitchable_bars_hidden():
        print("the reason, as the library wrote it", file=sys.stderr)
        raise ValueError("bad tensor")
    assert log_file.getvalue() == "the reason, as the library wrote it\n"
