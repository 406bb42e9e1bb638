"""steps.png (gyrejax/scheduler/plots.py): the reward's moving average and band, and a
step-time axis the steady steps set, with the compiling steps marked (issue 41)."""

import numpy as np

from gyrejax.scheduler.plots import moving_average, per_step


def test_step_time_axis_leaves_out_the_compile_step_and_marks_it(tmp_path):
    rng = np.random.default_rng(0)
    records = [
        {"step": s, "reward": 0.01 * s + rng.normal(0, 0.1), "step_s": 0.8 + 0.05 * rng.random(),
         "compiled": 0}
        for s in range(1, 41)
    ]  # fmt: skip
    records[0].update(step_s=18.0, compiled=12)  # the first step compiles
    drawn = per_step(tmp_path / "steps.png", records)
    assert (tmp_path / "steps.png").stat().st_size > 0
    assert drawn["compile_steps"] == [1]
    assert 0.85 <= drawn["step_time_top"] < 2.0  # set by the steady steps, not the 18 s
    assert drawn["window"] == 8


def test_the_moving_average_is_the_trailing_mean_and_its_band_the_sd():
    mean, std = moving_average([0.0, 1.0, 2.0, 3.0], window=2)
    np.testing.assert_allclose(mean, [0.0, 0.5, 1.5, 2.5])
    np.testing.assert_allclose(std, [0.0, 0.5, 0.5, 0.5])
