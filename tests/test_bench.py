"""verispec bench: config, prompt sets, metrics from hand-made records, task checks, and tiny end-to-end runs
(offline with the transformers peer, and serving against a `verispec serve` subprocess) on random checkpoints."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from verispec.bench.checks import code_body, code_valid, math_answer, math_correct
from verispec.bench.config import BenchConfig, PromptSettings, load_config, parse_variant
from verispec.bench.offline import Job, NativeRunner
from verispec.bench.records import RequestRecord, compare, mark_identical, record_from_stats, summarize
from verispec.bench.serving import apportion, arrival_offsets
from verispec.bench.workloads import BenchPrompt, build_prompt_set, describe_prompt_set
from verispec.cli import main
from verispec.config import SamplingParams, StopRules
from verispec.errors import VerispecError
from verispec.stats import RequestStats, RoundRecord

# ---- config ---------------------------------------------------------------------------------------------


def test_toml_then_quick_then_flags(tmp_path):
    toml = tmp_path / "bench.toml"
    toml.write_text('name = "t"\n[models]\ntarget = "T"\ndraft = "D"\nprecision = "bfloat16"\n'
                    '[prompts]\nper_workload = 7\nmax_output_tokens = 99\n[spec]\nbudget = 6\n'
                    'variants = ["off", "chain", "tree:s3_k2_d6"]\n[serving]\nrequest_rates = [0.5, "inf"]\n'
                    '[[serving.endpoints]]\nname = "ours"\nurl = "http://127.0.0.1:1"\n')
    config = load_config(toml, quick=True, overrides={"prompts": {"max_output_tokens": 20}, "models": {"target": None}})
    assert config.name == "t" and config.models.target == "T" and config.models.precision == "bfloat16"
    assert config.prompts.per_workload == 2  # --quick shrinks sizes
    assert config.prompts.max_output_tokens == 20  # flags win; None means "not given"
    assert config.serving.request_rates == (2.0,) and config.serving.endpoints[0].name == "ours"
    assert config.run_offline and config.run_serving
    chain, tree = config.variants()[1:]
    assert chain.spec.gamma == 5 and chain.verified_nodes == tree.verified_nodes == 6 and tree.matched_budget
    assert load_config(toml).serving.request_rates == (0.5, math.inf)


def test_config_errors_name_the_problem(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[prompts]\nper_workloads = 3\n")
    with pytest.raises(VerispecError, match=r"unknown key\(s\) \['per_workloads'\] in \[prompts\]"):
        load_config(bad)
    with pytest.raises(VerispecError, match="unknown variant 'tree'"):
        load_config(overrides={"spec": {"variants": ["off", "tree"]}})
    with pytest.raises(VerispecError, match="unknown workload"):
        load_config(overrides={"prompts": {"workloads": ["gsm8k"]}})
    with pytest.raises(VerispecError, match="serving needs endpoints"):
        load_config(overrides={"mode": "serving"})
    env = tmp_path / "env.toml"
    env.write_text('[[serving.launch]]\nname = "old"\nargs = ["--method", "none"]\nenv = { PYTHONPATH = "/tmp/old" }\n')
    assert load_config(env).serving.launch[0].env == (("PYTHONPATH", "/tmp/old"),)
    env.write_text('[[serving.launch]]\nname = "old"\nenv = { PYTHONPATH = 3 }\n')
    with pytest.raises(VerispecError, match=r"env must be a table of strings"):
        load_config(env)


@pytest.mark.parametrize("section, key, value, kind", [
    ("sampling", "temperature", "hot", "a number"), ("prompts", "max_output_tokens", 16.5, "an integer"),
    ("prompts", "workloads", "code", "a list"), ("prompts", "per_workload", True, "an integer"),
])
def test_config_types_are_checked_by_key(section, key, value, kind):
    with pytest.raises(VerispecError, match=rf"{section}\.{key} must be {kind}"):
        load_config(overrides={section: {key: value}})


def test_matched_budget_is_verified_nodes():
    spec = BenchConfig().spec  # budget 5
    assert parse_variant("chain", spec).verified_nodes == 5
    assert parse_variant("tree:s3_k2_d5", spec).matched_budget
    assert parse_variant("tree:dynamic:5", spec).matched_budget
    assert not parse_variant("tree:s3_k2_d6", spec).matched_budget
    assert not parse_variant("chain:6", spec).matched_budget
    assert parse_variant("hf_assisted", spec).num_drafts == 4 and parse_variant("tree:s3_k2_d5", spec).batchable


def test_self_variants_can_sweep_the_exit_layer():
    spec = BenchConfig().spec  # exit_layer 2, budget 5
    assert parse_variant("self", spec).spec.exit_layer == 2
    swept = parse_variant("self@5", spec)
    assert (swept.name, swept.spec.exit_layer, swept.spec.gamma, swept.spec.drafter) == ("self@5", 5, 4, "early_exit")
    assert parse_variant("self:3@1", spec).spec.gamma == 3 and parse_variant("self:3@1", spec).spec.exit_layer == 1
    for bad in ("self@0", "self@x", "chain@2"):
        with pytest.raises(VerispecError):
            parse_variant(bad, spec)


def test_eagle_variants_name_the_head_and_its_shape():
    spec = BenchConfig().spec  # budget 5
    chain = parse_variant("eagle", spec)
    assert (chain.spec.drafter, chain.spec.method, chain.spec.gamma) == ("eagle", "chain", 4)
    assert chain.needs_eagle and not chain.needs_draft and chain.batchable and chain.matched_budget
    tree = parse_variant("eagle-tree:dynamic:16", spec)
    assert (tree.spec.drafter, tree.spec.tree, tree.num_drafts) == ("eagle", "dynamic:16", 15)
    assert tree.batchable and not tree.matched_budget and parse_variant("eagle-tree:s2_k2_d5", spec).matched_budget
    with pytest.raises(VerispecError):
        parse_variant("eagle-tree", spec)


def test_bench_flags_override_defaults_only_when_given():
    from verispec.bench.cli import overrides_from_args
    from verispec.cli import build_parser

    args = build_parser().parse_args(["bench", "--temperature", "0.5", "--concurrency", "1,8", "--url",
                                      "a=http://h:1", "--url", "http://h:2/v1"])
    config = load_config(overrides=overrides_from_args(args))
    assert config.sampling.temperature == 0.5 and config.sampling.top_p == 1.0
    assert config.offline.concurrency == (1, 8) and config.models.device == "cpu"
    assert [(e.name, e.url) for e in config.serving.endpoints] == [("a", "http://h:1"), ("endpoint1", "http://h:2/v1")]


# ---- metrics from hand-made records ---------------------------------------------------------------------


def _record(variant="v", status="ok", tokens=0, ttft=None, e2e=None, gaps=(), repeat=0, prompt="p0", **kw):
    return RequestRecord(variant=variant, load="c1", repeat=repeat, prompt_id=prompt, task=kw.pop("task", "chat"),
                         prompt_tokens=5, max_tokens=16, status=status, finish_reason=kw.pop("finish", "length"),
                         output_tokens=tokens, ttft_s=ttft, e2e_s=e2e, token_gaps_s=list(gaps), **kw)


def test_summary_matches_hand_computed_values():
    records = [
        _record(tokens=10, ttft=0.1, e2e=1.0, gaps=[0.2, 0.0, 0.4], chunk_gaps_s=[0.2, 0.4], rounds=4, drafted=8,
                accepted=6, committed=9, tree_nodes=8, position_proposed=[4, 4], position_reached=[4, 3],
                position_accepted=[3, 3], histogram=[1, 0, 3], time_split_s={"draft": 0.2, "verify": 0.4}),
        _record(tokens=6, ttft=0.3, e2e=2.0, gaps=[0.6], chunk_gaps_s=[0.6], rounds=2, drafted=4, accepted=1,
                committed=5, tree_nodes=4, position_proposed=[2, 2], position_reached=[2, 1],
                position_accepted=[1, 0], histogram=[1, 1, 0], time_split_s={"draft": 0.1, "verify": 0.2}),
        _record(status="error", finish="error", e2e=0.5, error="boom"),
    ]
    s = summarize(records, wall_s=4.0)
    assert (s["requests"], s["ok"], s["errors"]) == (3, 2, 1)
    assert s["error_rate"] == pytest.approx(1 / 3)  # the failed request stays in the denominator
    assert s["tokens_per_s"] == pytest.approx(16 / 4.0) and s["requests_per_s"] == pytest.approx(2 / 4.0)
    ttft = s["latency_ms"]["ttft"]
    assert ttft["median"] == pytest.approx(200) and ttft["p95"] == pytest.approx(100 + 0.95 * 200)
    itl = s["latency_ms"]["itl"]  # pooled [0, 0.2, 0.4, 0.6]: linear interpolation, numpy's default
    assert itl["median"] == pytest.approx(300) and itl["p95"] == pytest.approx(400 + 0.85 * 200)
    assert s["latency_ms"]["e2e"]["n"] == 2  # latency over ok requests only
    tpot = s["latency_ms"]["tpot"]  # (1.0 - 0.1) / 9 = 100 ms and (2.0 - 0.3) / 5 = 340 ms per token
    assert tpot["n"] == 2 and tpot["median"] == pytest.approx(220)
    acc = s["acceptance"]
    assert acc["acceptance_rate"] == pytest.approx(7 / 12) and acc["committed_per_round"] == pytest.approx(14 / 6)
    assert acc["tree_nodes_per_round"] == pytest.approx(2.0)
    assert acc["per_position_unconditional"] == pytest.approx([4 / 6, 3 / 6])
    assert acc["per_position_conditional"] == pytest.approx([4 / 6, 3 / 4])
    assert acc["histogram"] == [2, 1, 3]
    assert s["time_split_ms"]["per_round"]["verify"] == pytest.approx(600 / 6)


def test_record_from_stats_agrees_with_stats_summary():
    rounds = [RoundRecord(4, 4, 5, "bonus", 0.01, 0.02, 0.001, tree_nodes=4),
              RoundRecord(4, 1, 2, "recovered", tree_nodes=4), RoundRecord(2, 0, 1, "cut", tree_nodes=2)]
    stats = RequestStats(prompt_tokens=3, generated_tokens=9, rounds=rounds, ttft_s=0.1, e2e_s=0.5,
                         token_gaps_s=[0.1, 0.2, 0.0, 0.0], chunk_gaps_s=[0.2])
    record = record_from_stats(_record(), stats)
    pooled = summarize([record], 1.0)["acceptance"]
    expected = stats.summary()
    assert pooled["acceptance_rate"] == pytest.approx(expected["acceptance_rate"])
    assert pooled["committed_per_round"] == pytest.approx(expected["committed_per_round"])
    assert pooled["per_position_conditional"] == pytest.approx(expected["per_position_acceptance"]["conditional"])
    assert pooled["per_position_unconditional"] == pytest.approx(expected["per_position_acceptance"]["unconditional"])
    assert pooled["histogram"] == expected["acceptance_histogram"]
    assert record.token_gaps_s == [0.2, 0.0, 0.0]  # the TTFT is not an inter-token gap


def test_speedups_pair_repeats_and_prompts():
    records = [_record("off", tokens=10, e2e=1.0, repeat=0), _record("off", tokens=10, e2e=1.0, repeat=1),
               _record("fast", tokens=10, e2e=0.5, repeat=0), _record("fast", tokens=10, e2e=0.25, repeat=1)]
    walls = {("off", "c1", 0): 1.0, ("off", "c1", 1): 1.0, ("fast", "c1", 0): 0.5, ("fast", "c1", 1): 0.25}
    rows = {r["variant"]: r for r in compare(records, walls, ("off",))}
    assert rows["fast"]["speedup_vs"]["off"] == pytest.approx(3.0)  # median of 2x and 4x
    assert rows["fast"]["per_prompt_speedup_vs"]["off"] == pytest.approx(3.0)
    assert rows["fast"]["tokens_per_s"] == pytest.approx(30.0) and rows["fast"]["tokens_per_s_range"] == [20.0, 40.0]
    assert rows["off"]["speedup_vs"] == {}


def test_draft_model_variants_get_the_draft_vocabulary():
    from verispec.bench.run import with_draft_vocab

    config = BenchConfig(spec=dataclasses.replace(BenchConfig().spec,
                                                  variants=("off", "chain", "tree:s3_k2_d5", "ngram", "self", "hf")))
    got = {v.name: v.spec.draft_vocab if v.spec is not None else "peer" for v in with_draft_vocab(config.variants(), 512)}
    assert got == {"off": None, "chain": 512, "tree:s3_k2_d5": 512, "ngram": None, "self": None, "hf": "peer"}


def test_speedup_interval_comes_from_paired_repeat_ratios():
    ratios = [0.9, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6]  # fast / off per repeat
    records, walls = [], {}
    for k, ratio in enumerate(ratios):
        records += [_record("off", tokens=10, e2e=1.0, repeat=k), _record("fast", tokens=10, e2e=1.0, repeat=k)]
        walls[("off", "c1", k)], walls[("fast", "c1", k)] = 1.0, 1.0 / ratio
    rows = {r["variant"]: r for r in compare(records, walls, ("off",))}
    interval = rows["fast"]["speedup_interval_vs"]["off"]
    # n = 8: k = 2 covers 1 - 2 * 9/256 = 0.93 < 0.95, so k = 1: (min, max) with 1 - 2/256.
    assert (interval["low"], interval["high"], interval["repeats"]) == (pytest.approx(0.9), pytest.approx(1.6), 8)
    assert interval["coverage"] == pytest.approx(1 - 2 / 256)
    assert rows["fast"]["speedup_vs"]["off"] == pytest.approx(1.25)
    few = compare(records[:4], {k: v for k, v in walls.items() if k[2] < 2}, ("off",))
    assert all(r["speedup_interval_vs"] == {} for r in few)  # two repeats give no interval, and none is shown


def test_identity_compares_same_prompt_and_repeat():
    records = [_record("off", tokens=2), _record("a", tokens=2), _record("b", tokens=2)]
    records[0].tokens, records[1].tokens, records[2].tokens = [1, 2], [1, 2], [1, 3]
    mark_identical(records, "off")
    assert [r.identical_to_baseline for r in records] == [None, True, False]


def test_arrivals_and_chunk_apportioning():
    offsets = arrival_offsets(2000, rate=4.0, burstiness=1.0, seed=3)
    assert offsets[0] == 0 and offsets == arrival_offsets(2000, 4.0, 1.0, 3)  # seeded: same for every endpoint
    assert offsets[-1] / 1999 == pytest.approx(0.25, rel=0.1)  # mean gap 1 / rate
    assert arrival_offsets(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    assert apportion([3, 1], 8) == [6, 2] and apportion([5], 2) == [2] and sum(apportion([1, 7, 2], 5)) == 5


# ---- task checks ----------------------------------------------------------------------------------------


def test_math_checker():
    assert math_answer(" 41 - 13 = 28. The answer is 28.") == "28"
    assert math_correct(" 3 * 4 = 12. The answer is 12.\nQuestion:", "12")
    assert not math_correct(" 3 * 4 = 12. The answer is 13.", "12")
    assert not math_correct(" 12", "12")  # no final answer stated
    assert math_answer("The answer is 1,200.") == "1200"


def test_code_checker():
    prompt = 'def double(x):\n    """Double x."""\n'
    assert code_valid(prompt, "    return 2 * x\n\nprint(double(2))\n")  # trimmed at the dedent
    assert code_body("    y = 1\n\n    return y\nz = 2\n") == "    y = 1\n\n    return y\n"
    assert not code_valid(prompt, "    return (2 *\n")  # cut mid-expression
    assert not code_valid(prompt, "\n\n")  # a docstring alone is not a body
    assert not code_valid(prompt, "return x\n")  # not indented: no body at all


# ---- prompt sets ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sharegpt_file(tmp_path_factory):
    """Five usable conversations (one reply too short, one prompt too long) plus a non-conversation."""
    rows = [{"id": f"c{i}_0", "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
            for i, (q, a) in enumerate([("What is 2 + 2?", "It is 4, because two and two make four."),
                                        ("Name a color.", "Red."),  # 4 bytes: too short at min 5
                                        ("Tell me a story " * 40, "Once upon a time."),  # prompt too long
                                        ("Say hi.", "Hi there! " * 30),
                                        ("Why is the sky blue?", "Rayleigh scattering of sunlight."),
                                        ("Count to three.", "One, two, three.")])]
    rows.append({"id": "x", "conversations": [{"from": "gpt", "value": "no question"}]})
    path = tmp_path_factory.mktemp("sharegpt") / "sharegpt.json"
    path.write_text(json.dumps(rows))
    return path


def test_sharegpt_sampling_follows_vllm_filters(byte_pair, sharegpt_file):
    from verispec.loading import load_tokenizer

    tokenizer = load_tokenizer(byte_pair[0])
    settings = PromptSettings(workloads=("sharegpt",), per_workload=10, sharegpt_path=str(sharegpt_file),
                              min_output_tokens=5, max_input_tokens=200, max_output_tokens=24)
    prompts = build_prompt_set(settings, tokenizer, max_context=512)
    texts = {p.text for p in prompts}
    assert len(prompts) == 4 and "Name a color." not in texts and not any("story" in t for t in texts)
    for p in prompts:
        assert p.template == "chat" and p.max_tokens == min(p.reference_tokens, 24)
    again = build_prompt_set(settings, tokenizer, max_context=512)
    assert describe_prompt_set(again)["sha256"] == describe_prompt_set(prompts)["sha256"]  # fixed seed


def test_failed_request_is_recorded_not_dropped(byte_pair):
    from verispec.loading import load_pair

    pair = load_pair(*byte_pair)
    variant = parse_variant("chain", BenchConfig().spec)
    runner = NativeRunner(pair, variant, SamplingParams(temperature=0), 60.0, lambda ids: "")
    good = BenchPrompt("p0", "chat", "hi", "raw", (5, 6, 7), 4)
    too_long = BenchPrompt("p1", "chat", "x", "raw", tuple([5] * 600), 4)  # beyond the 512-token context
    jobs = [Job(p, StopRules(max_tokens=4), 0, 0, "c1") for p in (good, too_long)]
    for concurrency in (1, 2):
        records = runner.run(jobs, concurrency)
        assert [r.status for r in records] == ["ok", "error"] and "context" in records[1].error
        s = summarize(records, 1.0)
        assert s["requests"] == 2 and s["error_rate"] == 0.5 and s["quality"]["chat"]["failed"] == 0.5


# ---- end to end -----------------------------------------------------------------------------------------

VARIANTS = "off,chain,tree:s2_k2_d5,ngram,hf,hf_assisted,hf_prompt_lookup"


@pytest.fixture(scope="module")
def quick_run(byte_pair, sharegpt_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    target, draft = byte_pair
    code = main(["bench", "--quick", "--target", str(target), "--draft", str(draft), "--out", str(out),
                 "--sharegpt", str(sharegpt_file), "--variants", VARIANTS, "--concurrency", "1,2",
                 "--max-output-tokens", "10", "--threads", "1", "--json"])
    assert code == 0
    return out, json.loads((out / "result.json").read_text())


def test_quick_run_writes_json_markdown_html_and_plots(quick_run):
    out, result = quick_run
    for name in ("result.json", "report.md", "report.html", "offline_throughput.png", "offline_latency.png",
                 "offline_acceptance.png", "offline_time_split.png"):
        assert (out / name).stat().st_size > 0, name
    markdown = (out / "report.md").read_text()
    assert "Latency at low load (c1)" in markdown and "![offline: output tokens/s by load]" in markdown
    assert "data:image/png;base64," in (out / "report.html").read_text()
    assert result["offline"]["requests"] and not any(r["status"] != "ok" for r in result["offline"]["requests"])


def test_rerender_recomputes_rows_from_stored_requests(quick_run, tmp_path, capsys):
    out, result = quick_run
    copy = tmp_path / "old"
    copy.mkdir()
    old = json.loads(json.dumps(result))
    for row in old["offline"]["rows"]:  # as if written before intervals existed, with a stale figure
        row.pop("speedup_interval_vs")
        row["tokens_per_s"] = -1.0
    (copy / "result.json").write_text(json.dumps(old))
    assert main(["bench", "--rerender", str(copy), "--no-plots"]) == 0
    redone = json.loads((copy / "result.json").read_text())
    assert redone["offline"]["rows"] == result["offline"]["rows"]
    assert "speedup vs off [95% interval]" in (copy / "report.md").read_text()
    (copy / "result.json").write_text("{}")
    assert main(["bench", "--rerender", str(copy / "result.json")]) == 2
    assert "holds no stored requests" in capsys.readouterr().err


def test_run_records_config_hardware_and_versions(quick_run, byte_pair):
    _, result = quick_run
    config = result["config"]
    assert config["models"]["target"] == str(byte_pair[0]) and config["models"]["precision"] == "float32"
    assert config["sampling"]["temperature"] == 0.0 and config["spec"]["budget"] == 5
    hardware, versions = result["environment"]["hardware"], result["environment"]["versions"]
    assert hardware["cpu_model"] and hardware["torch_threads"] == 1 and hardware["logical_cores"] >= 1
    assert all(versions[k] for k in ("python", "torch", "transformers", "verispec"))
    assert result["cache_policy"] and result["definitions"]["acceptance_rate"].startswith("accepted draft tokens")
    assert result["models"]["target"]["parameter_bytes"] > result["models"]["draft"]["parameter_bytes"] > 0


def test_every_variant_gets_the_same_prompts(quick_run):
    _, result = quick_run
    requests = result["offline"]["requests"]
    expected = {(p["prompt_id"], p["input_tokens"], p["max_tokens"]) for p in result["prompt_set"]["prompts"]}
    assert {p["task"] for p in result["prompt_set"]["prompts"]} == {"sharegpt", "code", "math"}
    for variant in VARIANTS.split(","):
        got = {(r["prompt_id"], r["prompt_tokens"], r["max_tokens"]) for r in requests
               if r["variant"] == variant and r["load"] == "c1"}
        assert got == expected, variant
    batched = {r["variant"] for r in requests if r["load"] == "c2"}
    assert batched == {"off", "chain", "tree:s2_k2_d5", "ngram"}  # every native variant batches; peers run alone


def test_rows_hold_speculation_records_and_peer_ratios(quick_run):
    _, result = quick_run
    rows = {(r["variant"], r["load"]): r for r in result["offline"]["rows"]}
    chain = rows[("chain", "c1")]
    assert chain["acceptance"]["drafted"] > 0 and chain["time_split_ms"]["measured"]
    assert chain["identical_to_baseline"] == 1.0  # greedy: speculation never changes the output
    tree = rows[("tree:s2_k2_d5", "c1")]
    assert tree["acceptance"]["tree_nodes_per_round"] > tree["acceptance"]["committed_per_round"] - 1
    for peer in ("hf", "hf_assisted", "hf_prompt_lookup"):
        row = rows[(peer, "c1")]
        assert row["ok"] == row["requests"] > 0 and row["latency_ms"]["ttft"]["n"] == row["ok"]
        assert row["speedup_vs"]["off"] > 0 and row["acceptance"]["acceptance_rate"] is None
    assert rows[("hf_assisted", "c1")]["speedup_vs"]["hf"] > 0
    assert result["offline"]["peer_settings"]["num_assistant_tokens"] == 4
    memory = result["models"]["memory_model"]
    assert memory["tree:s2_k2_d5@c1"]["speculative_state_bytes"] > 0 == memory["off@c1"]["speculative_state_bytes"]


def test_serving_against_verispec_serve(byte_pair, sharegpt_file):
    pytest.importorskip("openai", reason="serving mode talks to endpoints with the openai client")
    try:
        import verispec.server.cli  # noqa: F401
        import verispec.server.app  # noqa: F401
    except ImportError as err:
        pytest.skip(f"verispec serve is not available in this checkout ({err})")
    import asyncio

    from verispec.bench.config import ServingSettings
    from verispec.bench.serving import LoadPoint, launched_server, resolve_endpoint, run_load
    from verispec.loading import load_tokenizer

    target, draft = byte_pair
    tokenizer = load_tokenizer(target)
    settings = PromptSettings(workloads=("sharegpt",), per_workload=3, sharegpt_path=str(sharegpt_file),
                              max_output_tokens=8)
    prompts = build_prompt_set(settings, tokenizer, max_context=512)
    jobs = [Job(p, StopRules(max_tokens=p.max_tokens, eos_ids=(0,)), i, 0, "mc2") for i, p in enumerate(prompts)]
    serving = ServingSettings(timeout_s=60)
    with launched_server(["--target", str(target), "--draft", str(draft), "--method", "chain"]) as url:
        endpoint = resolve_endpoint("ours", url, None, server_stats=True)
        records, wall = asyncio.run(run_load(endpoint, jobs, LoadPoint("concurrency", 2), serving,
                                             SamplingParams(temperature=0), tokenizer, 0))
        bad = resolve_endpoint("typo", url, "no-such-model", server_stats=False)
        failed, _ = asyncio.run(run_load(bad, jobs[:1], LoadPoint("rate", math.inf), serving,
                                         SamplingParams(temperature=0), tokenizer, 0))
    assert wall > 0 and [r.status for r in records] == ["ok"] * len(jobs)
    for r in records:
        assert r.output_tokens > 0 and r.ttft_s is not None and r.e2e_s >= r.ttft_s
        assert r.drafted is not None and r.rounds > 0  # the server's own acceptance statistics
    assert failed[0].status == "error" and summarize(failed, 1.0)["error_rate"] == 1.0


def test_planner_check_reports_predicted_and_realised_per_gamma(tmp_path, capsys, byte_pair):
    """The planner check runs end to end; its verdicts follow from its own figures."""
    import json

    from verispec.bench import planner_check

    target, draft = byte_pair
    out = tmp_path / "check.json"
    assert planner_check.main(["--target", str(target), "--draft", str(draft), "--prompts", "1", "--max-tokens", "6",
                               "--repeats", "1", "--max-gamma", "2", "--profile-repeats", "2", "--json",
                               "--out", str(out)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data == json.loads(out.read_text())
    assert [row["gamma"] for row in data["rows"]] == [1, 2]
    for row in data["rows"]:
        assert row["error"] == pytest.approx(row["realised_speedup"] / row["predicted_speedup"] - 1)
        scaled = row["predicted_speedup"] * row["realised_committed_per_round"] / row["predicted_tokens_per_round"]
        assert row["cost_error"] == pytest.approx(row["realised_speedup"] / scaled - 1)
    best = max([1.0] + [row["realised_speedup"] for row in data["rows"]])
    assert data["best_realised_speedup"] == pytest.approx(best)
    assert data["planner_within_5pct_of_best"] == (data["planner_choice_realised"] >= 0.95 * best)
    assert data["settings"]["evaluation_prompts"] == 3 and data["settings"]["calibration_prompts"] > 0


def test_planner_check_scores_the_best_fixed_gamma_on_held_out_repeats():
    from verispec.bench.planner_check import report

    speeds = {"off": [1.0, 1.0, 1.0], "gamma1": [1.2, 1.5, 1.2], "gamma2": [1.4, 1.1, 1.3],
              "adaptive": [1.25, 1.25, 1.25], "hf": [1.0, 1.0, 1.0]}
    measured = {name: {"s_per_token": [1 / v for v in values], "drafted_per_round": [{}, {}, {}],
                       "committed_per_round": 2.0} for name, values in speeds.items()}
    profile_data = {"verify_ms": {"1": 5.0, "2": 5.5, "3": 6.0}, "decode_ms": 5.0, "draft_ms": 0.5,
                    "state_ms": 0.1, "threads": 1}
    data = report(profile_data, [0.8, 0.8], measured, [1, 2])
    # Best realised median: gamma 2 (1.3x). Held out: repeat 0 picks gamma 1 (1.35 vs 1.2 on repeats
    # 1-2) and scores 1.2; repeat 1 picks gamma 2 (1.35 vs 1.2), 1.1; repeat 2 picks gamma 1, 1.2.
    assert data["best_realised_speedup"] == pytest.approx(1.3)
    assert [h["gamma"] for h in data["best_fixed_held_out_picks"]] == [1, 2, 1]
    assert data["best_fixed_held_out"] == pytest.approx(1.2)
    assert not data["adaptive_at_least_best_fixed"] and data["adaptive_at_least_best_fixed_held_out"]


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
