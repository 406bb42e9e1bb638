"""Progress of a run's stages with rate and ETA: the warm start's demonstrations, its SFT
steps and the RL steps.

`Progress(stage, total, unit)` keeps the count; `update(done)` logs one line

  progress: demonstrations 37/128 (29%), 0.82 executions/s, ETA 1 min 51 s

at most every `every_s` seconds and once at the end, and, when stderr is a terminal,
redraws a bar in place there. The rate is measured from the first item done, so a
first step's compile counts once, not in every later estimate.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Iterable

from absl import logging

BAR_WIDTH = 30


def duration(seconds: float) -> str:
    """'1 h 02 min', '1 min 51 s', '12 s'."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    return f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


class Progress:
    """One stage's count, rate and ETA (see the module docstring)."""

    def __init__(self, stage: str, total: int, unit: str, every_s: float = 10.0, stream=None):
        self.stage, self.total, self.unit, self.every_s = stage, max(total, 0), unit, every_s
        self.stream = stream if stream is not None else sys.stderr
        self._start = time.monotonic()
        self._first: tuple[float, int] | None = None  # (time, count) at the first update
        self._logged_at = -float("inf")

    def line(self, done: int, now: float | None = None) -> str:
        """'<stage> done/total (p%), rate unit/s, ETA ...' (no rate before two points)."""
        now = time.monotonic() if now is None else now
        share = f" ({100 * done / self.total:.0f}%)" if self.total else ""
        text = f"{self.stage} {done}/{self.total}{share}"
        rate = self.rate(done, now)
        if rate:
            text += f", {rate:.3g} {self.unit}/s"
            if done < self.total:
                text += f", ETA {duration((self.total - done) / rate)}"
        if done >= self.total:
            text += f", done in {duration(now - self._start)}"
        return text

    def rate(self, done: int, now: float) -> float | None:
        if self._first is None:
            return None
        first_time, first_done = self._first
        if done <= first_done or now <= first_time:
            return None
        return (done - first_done) / (now - first_time)

    def update(self, done: int) -> str | None:
        """Records `done`; logs the line when due (or at the end) and returns it."""
        now = time.monotonic()
        if self._first is None:
            self._first = (now, done)
        text = self.line(done, now)
        if self.stream is not None and self.stream.isatty():
            filled = round(BAR_WIDTH * done / self.total) if self.total else BAR_WIDTH
            bar = "#" * filled + "." * (BAR_WIDTH - filled)
            end = "\n" if done >= self.total else ""
            self.stream.write(f"\r[{bar}] {text}\033[K{end}")
            self.stream.flush()
        if now - self._logged_at >= self.every_s or done >= self.total:
            self._logged_at = now
            logging.info("progress: %s", text)
            return text
        return None


async def gather(coroutines: Iterable[Awaitable], progress: Progress) -> list:
    """`asyncio.gather` of `coroutines` (results in order) with `progress` counting each
    one that finishes."""
    done = 0

    async def counted(coroutine: Awaitable):
        nonlocal done
        result = await coroutine
        done += 1
        progress.update(done)
        return result

    return list(await asyncio.gather(*(counted(c) for c in coroutines)))
