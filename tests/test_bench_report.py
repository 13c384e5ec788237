"""verispec.bench.report: number formatting, and the Markdown and HTML rendered from one list of blocks
(plots off here; tests/test_bench.py checks a whole report with its plots)."""

from __future__ import annotations

from verispec.bench.report import fmt, speedup_text, to_html, to_markdown, write_report

BLOCKS = [("h1", "Run"), ("p", "a < b"), ("table", ["variant", "tokens/s"], [["off", "1.0"], ["a|b", 2]]),
          ("img", "plot.png", "a plot")]


def test_numbers_are_formatted_and_missing_ones_shown_as_a_dash():
    assert (fmt(None), fmt(1.23456), fmt(2.5, 1, "x"), fmt(7, suffix=" s")) == ("–", "1.23", "2.5x", "7 s")
    row = {"speedup_vs": {"off": 1.234}, "speedup_interval_vs": {"off": {"low": 0.98, "high": 1.5}}}
    assert speedup_text(row, "off") == "1.23x [0.98-1.50]"
    assert speedup_text({"speedup_vs": {"off": 1.0}}, "off") == "1.00x"  # too few repeats: no interval
    assert speedup_text(row, "hf") == "–"


def test_markdown_escapes_table_pipes_and_links_images():
    assert to_markdown(BLOCKS) == ("# Run\n\na < b\n\n| variant | tokens/s |\n|---|---|\n| off | 1.0 |\n"
                                   "| a\\|b | 2 |\n\n![a plot](plot.png)\n")


def test_html_escapes_text_and_embeds_images(tmp_path):
    (tmp_path / "plot.png").write_bytes(b"PNG")
    page = to_html(BLOCKS, tmp_path, "t<1>")
    assert "<title>t&lt;1&gt;</title>" in page and "<p>a &lt; b</p>" in page
    assert "<tr><td>a|b</td><td>2</td></tr>" in page
    assert "src='data:image/png;base64,UE5H'" in page  # base64 of b"PNG": the report is one portable file


def test_write_report_renders_the_setup_of_a_result(tmp_path):
    result = {"name": "tiny", "created": "today", "duration_s": 1.5, "cache_policy": "fresh cache per request",
              "config": {"sampling": {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 0,
                                      "ignore_eos": False}, "spec": {"budget": 5}},
              "environment": {"hardware": {"cpu_model": "cpu9", "usable_cores": 2, "torch_threads": 1,
                                           "device": "cpu"}, "versions": {"torch": "2.0", "openai": None}},
              "prompt_set": {"count": 0, "sha256": "ab" * 32, "by_task": {}},
              "definitions": {"tokens_per_s": "tokens / s"}}
    paths = write_report(result, tmp_path / "out", with_plots=False)
    assert set(paths) == {"markdown", "html"}
    markdown = paths["markdown"].read_text()
    assert markdown.startswith("# verispec bench: tiny\n") and "took 1.5 s" in markdown
    assert "| hardware | cpu9; 2 usable cores; torch threads 1; device cpu |" in markdown
    assert "| versions | torch 2.0 |" in markdown  # packages that are not installed are left out
    assert "D = 5 verified nodes per round (chain gamma 4)" in markdown
    assert "| tokens_per_s | tokens / s |" in markdown and "<h1>verispec bench: tiny</h1>" in paths["html"].read_text()
