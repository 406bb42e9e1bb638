"""Records, roles, validation errors and status handling."""

import re
import subprocess
import sys

import numpy as np
import pytest

from gyrejax.trajectory import (
    Execution,
    ModelCall,
    known_roles,
    process,
    register_role,
    role_priority,
)


def call(call_id=0, prompt=(1, 2), output=(3,), *, ex="ex-1", role="main", lp=None, ver=None):
    return ModelCall(
        execution_id=ex,
        call_id=call_id,
        agent_id="main",
        role=role,
        prompt_ids=list(prompt),
        output_ids=list(output),
        logprobs=[-0.5] * len(output) if lp is None else lp,
        versions=[1] * len(output) if ver is None else ver,
        finish_reason="stop",
    )


def execution(calls, *, ex="ex-1", status="finished", reward=1.0, attempts=1, group="g"):
    return Execution(ex, "task", group, calls, status, reward, attempts)


def test_model_call_converts_dtypes_and_is_read_only():
    c = ModelCall("e", 3, "main", "main", [1, 2], np.array([3], np.int64), [-0.25], [2], "stop")
    assert c.prompt_ids.dtype == np.int32 and c.output_ids.dtype == np.int32
    assert c.logprobs.dtype == np.float32 and c.versions.dtype == np.int32
    assert not c.prompt_ids.flags.writeable
    with pytest.raises(ValueError, match="fit in int32"):
        ModelCall("e", 0, "main", "main", [2**40], [], [], [], "stop")
    with pytest.raises(ValueError, match="integers"):
        ModelCall("e", 0, "main", "main", [1.5], [], [], [], "stop")
    assert c == ModelCall("e", 3, "main", "main", [1, 2], [3], [-0.25], [2], "stop")
    assert c != ModelCall("e", 3, "main", "main", [1, 2], [4], [-0.25], [2], "stop")


def test_roles_registry():
    builtin = ("main", "main_summary", "sub_agent", "sub_agent_summary")
    assert [role_priority(r) for r in builtin] == [0, 1, 2, 3]
    register_role("critic_test_role", 5)
    assert known_roles()["critic_test_role"] == 5
    register_role("critic_test_role", 5)  # idempotent
    with pytest.raises(ValueError, match="already registered"):
        register_role("critic_test_role", 1)
    with pytest.raises(ValueError, match="unknown role 'nope'"):
        role_priority("nope")
    batch = process([execution([call(role="critic_test_role")])], row_length=8)
    assert batch.stats.admitted_trainable_tokens == 1


def err(executions, **kw):
    kw.setdefault("row_length", 64)
    with pytest.raises(ValueError) as info:
        process(executions, **kw)
    return str(info.value)


@pytest.mark.parametrize(
    "bad_call, kw, pieces",
    [
        (call(5, prompt=(1, -3)), {}, ["call 5", "-3"]),
        (call(5, output=(1, 77)), {"vocab_size": 50}, ["call 5", "77", "50"]),
        (call(5, prompt=(1, 2, 60)), {"vocab_size": 50}, ["call 5", "60"]),
        (call(5, output=(1, 2), lp=[-1.0]), {}, ["call 5", "1 logprobs for 2"]),
        (call(5, output=(1, 2), ver=[1, 1, 1]), {}, ["call 5", "3 versions for 2"]),
        (call(5, role="wizard"), {}, ["call 5", "'wizard'"]),
        (call(5, prompt=()), {}, ["call 5", "empty prompt"]),
        (call(5, output=(1,), lp=[float("nan")]), {}, ["call 5", "nan"]),
        (call(5, prompt=(1,) * 60, output=(2,) * 10), {}, ["call 5", "70", "row_length 64"]),
    ],
)
def test_call_validation_errors_name_execution_call_and_value(bad_call, kw, pieces):
    msg = err([execution([call(0), bad_call])], **kw)
    for piece in ["ex-1", *pieces]:
        assert piece in msg, (piece, msg)


def test_execution_validation_errors():
    assert "duplicate call_id 0" in err([execution([call(0), call(0)])])
    msg = err([execution([call(0)], status="exploded")])
    assert "ex-1" in msg and "'exploded'" in msg
    assert re.search(r"ex-1.*'finished' with reward None", err([execution([call()], reward=None)]))
    assert "timed_out" in err([execution([call()], status="timed_out", reward=None)])
    assert "inf" in err([execution([call()], reward=float("inf"))])
    assert "duplicate execution id 'ex-1'" in err([execution([call()]), execution([call()])])
    wrong = execution([call(0, ex="other")])
    assert "'other'" in err([wrong])


def test_eval_failed_within_budget_is_refused():
    msg = err([execution([call()], status="eval_failed", reward=None, attempts=1)])
    assert "ex-1" in msg and "re-evaluate" in msg and "eval_retry_budget=3" in msg


def test_statuses():
    exs = [
        execution([call(0, ex="a")], ex="a", reward=1.0),
        execution([call(0, ex="b")], ex="b", status="timed_out", reward=0.5),
        execution([call(0, ex="c")], ex="c", status="eval_failed", reward=None, attempts=3),
        execution([call(0, ex="d")], ex="d", status="no_artifact", reward=None),
        execution([], ex="e", status="no_artifact", reward=0.7),
    ]
    batch = process(exs, row_length=16)
    s = batch.stats
    assert s.executions_in == 5 and s.executions_used == 4
    assert s.executions_dropped == 1 and s.placeholders == 2
    assert batch.execution_ids == ("a", "b", "d", "e")
    np.testing.assert_array_equal(batch.execution_reward, [1.0, 0.5, 0.0, 0.0])
    r = np.array([1.0, 0.5, 0.0, 0.0])
    grpo = (r - r.mean()) / (r.std(ddof=1) + 1e-6)  # the default: the unbiased std
    np.testing.assert_allclose(batch.execution_advantage, grpo, rtol=1e-6)
    trained = set(batch.execution_index[batch.loss_weight > 0].tolist())
    assert trained == {0, 1, 2}  # "d" is a trained placeholder; "e" has no calls
    assert s.executions_trained == 3
    # A custom budget moves the line between dropping and refusing.
    assert process(exs[2:3], row_length=16, eval_retry_budget=3).stats.executions_dropped == 1
    assert "re-evaluate" in err(exs[2:3], eval_retry_budget=4)


def test_argument_validation():
    ok = [execution([call()])]
    assert "row_length" in err(ok, row_length=0)
    assert "j_max" in err(ok, j_max=0)
    assert "rows_per_micro_step" in err(ok, rows_per_micro_step=0)
    msg = err(ok, advantage="ppo")
    assert "ppo" in msg and "grpo" in msg and "rloo" in msg


def test_trajectory_package_never_imports_jax():
    code = (
        "import sys, gyrejax.trajectory as t; "
        "t.process(t.generate_executions(1, 2, seed=0, turns=(2, 3)), row_length=8192); "
        "assert not any(m == 'jax' or m.startswith('jax.') for m in sys.modules), 'jax imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
