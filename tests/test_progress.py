"""Progress lines with rate and ETA (gyrejax/progress.py), and the bar on a terminal."""

import asyncio
import io

from gyrejax.progress import Progress, duration, gather


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_the_line_gives_the_rate_from_the_first_item_and_the_eta():
    progress = Progress("SFT steps", 100, "steps", stream=io.StringIO())
    progress._first = (10.0, 1)  # the first step (a compile) finished at t = 10 s
    assert progress.line(1, now=10.0) == "SFT steps 1/100 (1%)"
    # 20 more steps in 10 s: 2 steps/s, 79 left: 40 s.
    assert progress.line(21, now=20.0) == "SFT steps 21/100 (21%), 2 steps/s, ETA 40 s"
    assert "done in" in progress.line(100, now=59.5)


def test_durations_read_as_a_person_says_them():
    assert [duration(s) for s in (12, 111, 3720)] == ["12 s", "1 min 51 s", "1 h 02 min"]


def test_a_terminal_gets_a_bar_redrawn_in_place_and_the_log_a_line_at_the_end(caplog):
    terminal = Terminal()
    progress = Progress("demonstrations", 4, "executions", every_s=3600, stream=terminal)

    async def item(i):
        await asyncio.sleep(0.01 * i)
        return i

    # On absl's own logger: a test that parsed and then unparsed flags earlier in the
    # same worker leaves it at WARNING, which the root logger's level does not override.
    caplog.set_level("INFO", logger="absl")
    assert asyncio.run(gather([item(i) for i in range(4)], progress)) == [0, 1, 2, 3]
    drawn = terminal.getvalue()
    assert drawn.count("\r[") == 4 and drawn.endswith("\n")
    assert "[" + "#" * 30 + "] demonstrations 4/4 (100%)" in drawn
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("progress:")]
    assert logged[0].startswith("progress: demonstrations 1/4") and "4/4" in logged[-1]
