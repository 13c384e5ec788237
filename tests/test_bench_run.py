"""verispec.bench.run: draft-vocabulary resolution per variant, the serving loop's server lifetimes, and
the strict-JSON result writer."""

from __future__ import annotations

import dataclasses

import pytest

from verispec.bench.config import BenchConfig
from verispec.config import SamplingParams


def test_draft_model_variants_get_the_draft_vocabulary():
    from verispec.bench.run import with_draft_vocab

    config = BenchConfig(spec=dataclasses.replace(BenchConfig().spec,
                                                  variants=("off", "chain", "tree:s3_k2_d5", "ngram", "self", "hf")))
    got = {v.name: v.spec.draft_vocab if v.spec is not None else "peer" for v in with_draft_vocab(config.variants(), 512)}
    assert got == {"off": None, "chain": 512, "tree:s3_k2_d5": 512, "ngram": None, "self": None, "hf": "peer"}


@pytest.mark.parametrize("relaunch", [False, True])
def test_serving_relaunch_gives_every_repeat_fresh_servers(monkeypatch, relaunch):
    """With ``relaunch`` every repeat gets its own server processes (repeats outermost, every load point
    inside); without, one process per launched variant serves every load point and repeat."""
    import contextlib

    import verispec.bench.serving as serving
    from verispec.bench.config import LaunchSpec, ServingSettings
    from verispec.bench.run import _serving

    launches, loads_run, environments = [], [], []

    @contextlib.contextmanager
    def fake_server(args, env=None):
        launches.append(args[-1])
        environments.append((args[-1], env))
        yield f"http://127.0.0.1:{len(launches)}"

    async def fake_load(endpoint, jobs, load, settings, sampling, tokenizer, seed, bar=None):
        if jobs[0][2] >= 0:  # not the warm-up
            loads_run.append((endpoint.name, endpoint.url, load.name, jobs[0][2]))
        return [], 1.0

    monkeypatch.setattr(serving, "launched_server", fake_server)
    monkeypatch.setattr(serving, "run_load", fake_load)
    monkeypatch.setattr(serving, "resolve_endpoint",
                        lambda name, url, model, stats: serving.ResolvedEndpoint(name, url, "m", stats))
    settings = ServingSettings(launch=(LaunchSpec("a", ("--x", "a")),
                                       LaunchSpec("b", ("--x", "b"), env=(("PYTHONPATH", "/old"),))),
                               request_rates=(), max_concurrency=(1, 4), repeats=3, relaunch=relaunch)
    config = dataclasses.replace(BenchConfig(), serving=settings, mode="serving")
    _serving(config, None, ["p"], SamplingParams(), lambda p, i, repeat, load: (p, i, repeat, load), False)
    assert len(launches) == (6 if relaunch else 2)
    assert {name: env for name, env in environments} == {"a": {}, "b": {"PYTHONPATH": "/old"}}
    assert len(loads_run) == 2 * 2 * 3  # endpoints x load points x repeats
    servers_per_repeat = {repeat: {url for _, url, _, r in loads_run if r == repeat} for repeat in range(3)}
    if relaunch:
        assert all(len(urls) == 2 for urls in servers_per_repeat.values())
        assert len(set().union(*servers_per_repeat.values())) == 6  # no process serves two repeats
        assert [r for _, _, _, r in loads_run] == sorted(r for _, _, _, r in loads_run)  # repeats outermost
    else:
        assert set().union(*servers_per_repeat.values()) == {"http://127.0.0.1:1", "http://127.0.0.1:2"}


def test_written_result_is_strict_json(tmp_path):
    import json
    import math

    from verispec.bench.run import jsonable, write_result

    assert jsonable({"rates": (1.0, math.inf), 3: [-math.inf, None]}) == {"rates": [1.0, "inf"], "3": ["-inf", None]}
    path = write_result({"rate": math.nan, "rows": ({"x": 1},)}, tmp_path / "out")
    assert path == tmp_path / "out" / "result.json"
    assert json.loads(path.read_text(), parse_constant=pytest.fail) == {"rate": "nan", "rows": [{"x": 1}]}
