"""The progress display of `ctxreplay run` (issue 10, point 7): input bytes as a bar with an ETA,
files and session groups done out of their totals, calls replayed so far, and what the run is
doing now. On stderr, only when stderr is a terminal (the CLI decides), never with -q or --json."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# what a long step calls with a one-line note of what it is doing now
Progress = Callable[[str], None]


class RunProgress:
    """A rich live display; `note` takes the runner's one-line messages."""

    def __init__(self, console: Any = None) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self._p = Progress(
            TextColumn("[bold]ctxreplay run[/]"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
            TextColumn("files {task.fields[files]}  groups {task.fields[groups]}  calls {task.fields[calls]:,}"),
            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[now]}"),
            console=console or Console(stderr=True), transient=True)
        self._task: Any = None
        self.totals = (0, 0)
        self.done = [0, 0, 0]  # files, groups, calls

    def start(self, files: int, groups: int, nbytes: int) -> None:
        self.totals = (files, groups)
        self._p.start()
        self._task = self._p.add_task("run", total=max(nbytes, 1), files=f"0/{files}", groups=f"0/{groups}",
                                      calls=0, now="")

    def advance(self, files: int, groups: int, nbytes: int, calls: int) -> None:
        if self._task is None:
            return
        self.done = [self.done[0] + files, self.done[1] + groups, self.done[2] + calls]
        # drawn now, not at the next tick of the display's timer (10 a second): a batch that takes
        # less than a tick would otherwise never be shown
        self._p.update(self._task, advance=nbytes, files=f"{self.done[0]}/{self.totals[0]}",
                       groups=f"{self.done[1]}/{self.totals[1]}", calls=self.done[2], refresh=True)

    def note(self, msg: str) -> None:
        if self._task is not None:
            from rich.markup import escape

            from ctxreplay.pipeline.core.termtext import shown

            self._p.update(self._task, now=escape(shown(msg[:40])))  # shown as it is: no markup, no escapes

    def close(self) -> None:
        if self._task is not None:
            self._p.stop()
            self._task = None


__all__ = ["RunProgress"]
