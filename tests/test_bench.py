"""verispec bench: config, the ShareGPT prompt set, and tiny end-to-end runs (offline with the transformers
peer, and serving against a `verispec serve` subprocess) on random checkpoints. Each bench module's own unit
tests live in tests/test_bench_<module>.py."""

from __future__ import annotations

import json
import math

import pytest

from verispec.bench.config import BenchConfig, PromptSettings, load_config, parse_variant
from verispec.bench.offline import Job
from verispec.bench.records import summarize
from verispec.bench.workloads import build_prompt_set, describe_prompt_set
from verispec.cli import main
from verispec.config import SamplingParams, StopRules
from verispec.errors import VerispecError

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


