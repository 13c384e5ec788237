"""Predicted outputs (verispec.drafters.prediction): the prediction's tokens are point-mass drafts, so
the output is plain decoding's whatever the prediction says; a right prediction is accepted in long runs."""

from __future__ import annotations

import pytest

from verispec.audit import goodness_of_fit, sample_continuations, sample_seeds, sequence_probabilities
from verispec.batch import BatchEngine, BatchRequest
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.drafters.prediction import PREDICTION_DRAFTS, PredictionDrafter
from verispec.engine import SpecEngine
from verispec.loading import ModelPair, load_pair

CHAIN = SpecConfig(gamma=PREDICTION_DRAFTS)
PLAIN = SpecConfig(method="none")


@pytest.fixture(scope="module")
def pair(byte_pair) -> ModelPair:
    return load_pair(*byte_pair, draft_weights="native")


def test_a_copy_proceeds_through_the_prediction_in_order():
    drafter = PredictionDrafter([1, 2, 3, 1, 2, 4, 5, 6], max_n=2)
    assert drafter.lookup([1, 2], 3) == [3, 1, 2]  # the first "1 2", at the cursor
    assert drafter.lookup([1, 2, 3, 1, 2], 2) == [4, 5]  # the second: after the cursor, not the first again
    assert drafter.lookup([9], 2) == []  # nothing matches: no drafts
    assert drafter.lookup([], 2) == []


def test_after_an_edit_the_drafts_resynchronise():
    drafter = PredictionDrafter(list(range(10, 30)), max_n=3)
    assert drafter.lookup([10, 11, 12], 3) == [13, 14, 15]
    assert drafter.lookup([10, 11, 12, 99, 98], 3) == []  # the output departs from the prediction
    assert drafter.lookup([10, 11, 12, 99, 98, 16], 3) == []  # one shared token is not enough to realign
    assert drafter.lookup([10, 11, 12, 99, 98, 16, 17], 3) == [18]  # two are: one draft after the miss
    assert drafter.lookup([10, 11, 12, 99, 98, 16, 17, 18], 3) == [19, 20]  # a full hit doubles the drafts


def test_drafts_per_round_follow_how_much_of_the_prediction_is_accepted():
    drafter = PredictionDrafter(list(range(100)), max_n=2, drafts=8)
    output = [0, 1]
    assert drafter.lookup(output, 8) == list(range(2, 10))
    output += [2, 3, 4, 77]  # 3 accepted, then the output departs
    assert drafter.lookup(output + [5, 6], 8) == [7, 8, 9, 10]  # 3 + 1 drafts


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_output_is_plain_decodings_whatever_the_prediction(pair, temperature):
    prompt = pair.tokenizer.encode("Edit: ", add_special_tokens=False)
    stop = StopRules(max_tokens=40, ignore_eos=True)
    sampling = SamplingParams(temperature=temperature)
    plain = SpecEngine(pair.target).generate(prompt, sampling, PLAIN, stop, seed=5).tokens
    for prediction in (plain, plain[:10] + [7, 7, 7] + plain[14:], list(reversed(plain)), []):
        result = SpecEngine(pair.target, PredictionDrafter(prediction)).generate(prompt, sampling, CHAIN, stop, seed=5)
        if temperature == 0:
            assert result.tokens == plain
        if prediction == plain and temperature == 0:  # a right prediction: long accepted runs
            assert result.stats.accepted >= 30 and len(result.stats.rounds) <= 8


def test_sampled_output_follows_the_target_exactly(pair):
    prompt = pair.tokenizer.encode("ab", add_special_tokens=False)
    sampling = SamplingParams(temperature=1.0, top_k=3)
    likely = SpecEngine(pair.target).generate(prompt, SamplingParams(temperature=0), PLAIN,
                                              StopRules(max_tokens=4, ignore_eos=True)).tokens
    engine = SpecEngine(pair.target, PredictionDrafter(likely))
    counts, drafted, accepted = sample_continuations(engine, prompt, sampling, CHAIN, 4, sample_seeds(2, 0, 1500))
    fit = goodness_of_fit(counts, sequence_probabilities(pair.target, prompt, list(counts), sampling))
    assert not fit.impossible and fit.p_value > 1e-3 and fit.tv < 2 * fit.noise_floor, fit
    assert 0 < accepted < drafted


def test_batched_rows_with_and_without_predictions_decode_as_alone(pair):
    stop = StopRules(max_tokens=30, ignore_eos=True)
    prompts = [pair.tokenizer.encode(text, add_special_tokens=False) for text in ("one ", "two ", "three ")]
    greedy = SamplingParams(temperature=0)
    alone = [SpecEngine(pair.target).generate(p, greedy, PLAIN, stop).tokens for p in prompts]
    predictions = [alone[0], None, alone[2][:12] + [1, 2, 3]]
    for spec in (SpecConfig(gamma=3), PLAIN):
        engine = BatchEngine(pair.target, pair.draft, spec, max_batch=3)
        outputs: dict[str, list[int]] = {}
        for index, (prompt, prediction) in enumerate(zip(prompts, predictions)):
            for event in engine.add(BatchRequest(str(index), prompt, greedy, stop, prediction=prediction)):
                outputs.setdefault(event.request_id, []).extend(event.tokens)
        stats = {}
        while engine.active:
            for event in engine.step():
                outputs.setdefault(event.request_id, []).extend(event.tokens)
                if event.finished:
                    stats[event.request_id] = event.stats
        assert [outputs[str(i)] for i in range(3)] == alone, spec
        assert stats["0"].accepted >= 20 and stats["2"].accepted >= 8  # the prediction drafts, even without a drafter


def test_generate_with_a_prediction_file_prints_plain_decodings_text(capsys, byte_pair, tmp_path):
    import json

    from verispec.cli import main

    target, draft = byte_pair
    common = ["generate", "Edit: ", "--target", str(target), "--max-tokens", "30", "--ignore-eos", "--json"]
    assert main(common + ["--no-spec"]) == 0
    plain = json.loads(capsys.readouterr().out)
    (tmp_path / "old.txt").write_text(plain["text"])
    assert main(common + ["--prediction", str(tmp_path / "old.txt")]) == 0
    predicted = json.loads(capsys.readouterr().out)
    assert predicted["tokens"] == plain["tokens"] and predicted["stats"]["accepted"] >= 20
    assert main(common + ["--prediction", str(tmp_path / "missing.txt")]) == 2
    assert "cannot read --prediction" in capsys.readouterr().err


def test_the_server_takes_openais_prediction_and_reports_its_tokens(byte_pair):
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    import json as json_module

    from test_server import MODEL, http, serving
    from verispec.server.app import create_app
    from verispec.server.scheduler import ServerConfig

    pair = load_pair(*byte_pair)
    messages = [{"role": "user", "content": "Fix the typo: teh cat"}]
    for spec in (SpecConfig(gamma=3), PLAIN):
        with serving(create_app(pair, spec, ServerConfig(max_batch=4, timeout_s=60))) as live:
            client = live.client()
            # ASCII output (this random model's bytes would not survive decoding), so the text re-encodes exactly
            options = dict(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                           extra_body={"structured_outputs": {"regex": "[a-z ]{10,60}"}})
            plain = client.chat.completions.create(**options)
            text = plain.choices[0].message.content
            assert plain.usage.completion_tokens_details is None or \
                plain.usage.completion_tokens_details.accepted_prediction_tokens in (None, 0)
            predicted = client.chat.completions.create(prediction={"type": "content", "content": text}, **options)
            assert predicted.choices[0].message.content == text
            details = predicted.usage.completion_tokens_details
            assert details.accepted_prediction_tokens >= 20 and details.rejected_prediction_tokens >= 0
            chunks = list(client.chat.completions.create(
                prediction={"type": "content", "content": [{"type": "text", "text": text}]}, stream=True,
                stream_options={"include_usage": True}, **options))
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
            assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens >= 20
            status, _, body = http(f"{live.url}/v1/chat/completions",
                                   {"model": MODEL, "messages": messages, "prediction": {"type": "image"}})
            assert status == 400 and json_module.loads(body)["error"]["param"] == "prediction"
