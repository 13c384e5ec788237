"""verispec.bench.plots: which figures a result gets (a figure with nothing to show is left out) and that
each one is written as a PNG."""

from __future__ import annotations

import pytest

from verispec.bench import plots
from verispec.bench.plots import make_all
from verispec.bench.records import RequestRecord, compare

pytest.importorskip("matplotlib", reason="plots are drawn with matplotlib (the bench's plots extra)")

SPEC = dict(rounds=4, drafted=8, accepted=4, committed=8, tree_nodes=8, position_proposed=[4, 4],
            position_reached=[4, 2], position_accepted=[2, 2], histogram=[2, 0, 2],
            time_split_s={"draft": 0.04, "verify": 0.2})


def _section(*units) -> dict:
    """An offline section from (variant, load, e2e seconds, spec fields) units, one request each."""
    records = [RequestRecord(variant=v, load=load, repeat=0, prompt_id="p0", task="chat", prompt_tokens=5,
                             max_tokens=8, finish_reason="length", output_tokens=8, ttft_s=0.1, e2e_s=e2e,
                             token_gaps_s=[0.1] * 7, chunk_gaps_s=[0.1] * 7, **spec) for v, load, e2e, spec in units]
    walls = {(r.variant, r.load, 0): r.e2e_s for r in records}
    return {"rows": compare(records, walls, ("off",)), "requests": [r.as_dict() for r in records]}


def test_a_speculative_row_gets_its_time_split_figure(tmp_path):
    section = _section(("off", "c1", 1.0, {}), ("chain", "c1", 0.5, SPEC))
    assert plots.time_split(section, tmp_path / "split.png", "offline")
    assert (tmp_path / "split.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plain = _section(("off", "c1", 1.0, {}))
    assert not plots.acceptance(plain, tmp_path / "a.png", "offline")  # no draft positions to plot
    assert not plots.time_split(plain, tmp_path / "t.png", "offline")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["split.png"]


def test_figures_with_nothing_to_show_are_left_out(tmp_path):
    section = _section(("off", "c1", 1.0, {}))  # plain decoding: no rounds, no acceptance
    section["requests"][0]["status"] = "error"  # and no ok request for the latency CDFs
    images = make_all({"offline": section, "serving": {"rows": []}}, tmp_path)
    assert images == {"offline_throughput": "offline_throughput.png"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["offline_throughput.png"]
    assert (tmp_path / "offline_throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
