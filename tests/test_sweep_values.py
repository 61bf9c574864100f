"""A big sweep's values are checked before any job is composed: through the real CLI, a
1000-value sweep whose last value is bad exits 2 with one line naming it, after a few seconds of CPU
(before: each job composed and validated in turn, about 0.27 s a job, 267 s before that line), and no
store opened."""
from __future__ import annotations

import resource

import pytest
from entrypoints import start, wait


@pytest.mark.parametrize("key,bad,rule", [("seq", "0", "an integer >= 1 (at most 2**63 - 1, torch's int64)"),
                                          ("decode.repeats", "-3", "an integer from 1 to 10000")])
def test_the_first_bad_value_of_a_thousand_is_reported_at_once(tmp_path, key, bad, rule):
    values = ",".join([*(str(v) for v in range(64, 64 + 999)), bad])
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = start(tmp_path, "decode", "-m", f"{key}={values}")
    try:
        rc, out, err = wait(p, timeout=120)
    finally:
        p.kill()
        p.wait()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    assert rc == 2, (out + err)[-2000:]
    lines = [ln for ln in (out + err).splitlines() if ln.strip() and "validating" not in ln]
    assert len(lines) == 1 and lines[0].startswith(f"config error: {key}={int(bad)}: must be {rule} [job: "), lines
    assert f" {key}={bad} " in lines[0].replace("[job: ", "[job:  "), lines
    assert cpu < 10, cpu
    assert not (tmp_path / "mlflow.db").exists()
