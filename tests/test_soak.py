"""experiments/soak.py, kept working: a short soak of a real `verispec serve` on the embedded tiny pair,
its checks failing on the faults they look for, and its argument errors."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

SCRIPT = Path(__file__).resolve().parent.parent / "experiments" / "soak.py"


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("experiments_soak", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script is executed
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_short_soak_of_a_started_server_passes(soak, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "soak.json"
    code = soak.main(["--target", "tiny", "--requests", "60", "--concurrency", "8", "--warmup", "20",
                      "--max-tokens", "16", "--quiet", "--out", str(out)])
    record = json.loads(out.read_text())
    assert code == 0, json.dumps(record["checks"])
    assert record["passed"] and set(record["checks"]) == {
        "no_5xx", "all_accounted", "invalid_refused", "server_counted", "slots_free", "rss_growth", "clean_exit"}
    assert record["requests"] == 60 and record["refused"] == 3  # 5% invalid
    assert record["disconnected"] >= 1 and record["completed"] + record["disconnected"] == record["well_formed"]
    assert record["server"]["aborted_choices"] >= 1  # the disconnects reached the engine
    assert record["rss"]["baseline_bytes"] > 0 and record["server"]["exit_status"] == 0


def test_checks_fail_on_the_faults_they_look_for(soak):
    settings = soak.Settings(requests=4, warmup=1)
    planned = soak.plan_requests(soak.Settings(requests=4, disconnect=0.25, invalid=0.25, seed=3), "m")
    kinds = sorted(p.kind for p in planned)
    assert kinds == ["disconnect", "invalid", "normal", "normal"]
    outcomes = []
    for item in planned:  # every normal one fails: a 500, a stream cut short; the invalid one answered 200
        if item.kind == "disconnect":
            outcomes.append(soak.Outcome(item.index, item.kind, item.route, True, 200, "disconnected"))
        elif item.kind == "invalid":
            outcomes.append(soak.Outcome(item.index, item.kind, item.route, False, 200, "failed"))
        elif not any(o.status == 500 for o in outcomes):
            outcomes.append(soak.Outcome(item.index, item.kind, item.route, False, 500, "failed"))
        else:
            outcomes.append(soak.Outcome(item.index, item.kind, item.route, True, None, "failed"))
    counters = 'verispec:request_success_total{finished_reason="length",model_name="m"} %d\n'
    record = soak.summarize(settings, planned, outcomes, 1.0, {"samples": [], "baseline": 100, "end": 106},
                            counters % 0, counters % 2, 1.0, 0.0, pid=1)
    assert {name: check["passed"] for name, check in record["checks"].items()} == {
        "no_5xx": False, "all_accounted": False, "invalid_refused": False, "server_counted": False,
        "slots_free": False, "rss_growth": False}
    assert record["checks"]["no_5xx"]["value"] == 2 and record["checks"]["all_accounted"]["value"] == 2
    assert not soak.passed(record)
    healthy = [soak.Outcome(p.index, p.kind, p.route, p.stream, 200 if p.kind != "invalid" else 400,
                            {"normal": "completed", "disconnect": "disconnected", "invalid": "refused"}[p.kind])
               for p in planned]
    record = soak.summarize(settings, planned, healthy, 1.0, {"samples": [], "baseline": 100, "end": 104},
                            counters % 0, counters % sum(p.choices for p in planned if p.kind != "invalid"),
                            0.0, 0.0, pid=1)
    assert soak.passed(record), record["checks"]


@pytest.mark.parametrize("argv,message", [
    (["--requests", "0"], "--requests"),
    (["--disconnect", "0.7", "--invalid", "0.5"], "--disconnect"),
    (["--requests", "10", "--warmup", "10"], "--warmup"),
    (["--server-pid", "1"], "--server-pid goes with --url"),
])
def test_bad_arguments_are_one_line_errors(soak, capsys, argv, message):
    assert soak.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
