"""Serving the targets whose caches do not batch (transformers-backed, compressed attention): SerialEngine runs
them one request at a time behind BatchEngine's interface, with SpecEngine's tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")  # starlette's TestClient

from fastapi.testclient import TestClient  # noqa: E402

from verispec.batch import BatchRequest, SerialEngine  # noqa: E402
from verispec.config import SamplingParams, SpecConfig, StopRules  # noqa: E402
from verispec.errors import VerispecError  # noqa: E402
from verispec.loading import build_engine, load_pair  # noqa: E402
from verispec.server.app import create_app  # noqa: E402
from verispec.server.scheduler import ServerConfig  # noqa: E402
from verispec.testing import make_byte_tokenizer, make_compressed_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def unbatched(tmp_path_factory, byte_pair):
    """name -> a pair whose target does not batch: the byte pair through transformers, and a compressed-attention
    target with the byte pair's draft."""
    root = tmp_path_factory.mktemp("compressed-target")
    make_compressed_checkpoint(root, make_byte_tokenizer(root), seed=3)
    return {"hf": load_pair(*byte_pair, backend="hf"), "compressed": load_pair(root, byte_pair[1])}


@pytest.mark.parametrize("name", ["hf", "compressed"])
@pytest.mark.parametrize("spec", [SpecConfig(gamma=3), SpecConfig(method="tree", tree="s2_k2_d4"),
                                  SpecConfig(gamma=2, drafter="ngram")], ids=["chain", "tree", "ngram"])
def test_serial_engine_gives_spec_engines_tokens(unbatched, name, spec):
    pair = unbatched[name]
    assert not pair.target.capabilities.batching
    engine = SerialEngine(build_engine(pair, spec), spec, max_len=64)
    sampling = SamplingParams(temperature=1.0, top_k=12)
    for seed, prompt in enumerate([[5, 9, 33], [70, 71, 72, 73, 74], [2]]):
        stop = StopRules(max_tokens=10 + seed, ignore_eos=True)
        events = engine.add(BatchRequest(str(seed), prompt, sampling, stop, seed=seed))
        assert engine.active == 1 and not engine.has_capacity
        while engine.active:
            events += engine.step()
        alone = build_engine(pair, spec).generate(prompt, sampling, spec, stop, seed=seed)
        assert [t for e in events for t in e.tokens] == alone.tokens
        assert [e.finished for e in events] == [False] * (len(events) - 1) + [True]
        assert events[-1].finish_reason == "length" and events[-1].stats.generated_tokens == len(alone.tokens)
    assert engine.step() == []


def test_serial_engine_aborts_and_refuses_what_it_cannot_serve(unbatched):
    spec = SpecConfig(gamma=2)
    engine = SerialEngine(build_engine(unbatched["hf"], spec), spec, max_len=64)
    engine.add(BatchRequest("a", [1, 2, 3], SamplingParams(temperature=0), StopRules(max_tokens=20)))
    assert engine.abort("b") is None and engine.active == 1
    event = engine.abort("a")
    assert event.finish_reason == "abort" and event.stats is not None and engine.has_capacity
    for request, message in [
        (BatchRequest("c", [1], stop=StopRules(max_tokens=4), logprobs=2), "log-probabilities are served for the natively batched models"),
        (BatchRequest("d", [1], stop=StopRules(max_tokens=4), prediction=[4, 5]), "predicted outputs are served for the natively batched"),
        (BatchRequest("e", [1], stop=StopRules(max_tokens=64)), "exceeds the context of 64 tokens"),
    ]:
        with pytest.raises(VerispecError, match=message):
            engine.add(request)
    assert engine.has_capacity


@pytest.mark.parametrize("name", ["hf", "compressed"])
def test_the_server_serves_a_target_that_does_not_batch(unbatched, name):
    pair, spec = unbatched[name], SpecConfig(gamma=3)
    app = create_app(pair, spec, ServerConfig(max_batch=8, max_model_len=64), model_name=name)
    with TestClient(app) as client:
        for prompt in ["Hi", "The cat"]:
            answer = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                          "ignore_eos": True}).json()
            ids = pair.tokenizer.encode(prompt, add_special_tokens=False)
            alone = build_engine(pair, spec).generate(ids, SamplingParams(temperature=0), spec,
                                                      StopRules(max_tokens=6, ignore_eos=True))
            assert answer["choices"][0]["text"] == pair.tokenizer.decode(alone.tokens, skip_special_tokens=True)
            assert answer["usage"]["completion_tokens"] == 6
        both = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 5, "n": 2, "seed": 4,
                                                    "temperature": 1.0, "ignore_eos": True}).json()
        assert sorted(c["index"] for c in both["choices"]) == [0, 1]
        assert all(c["finish_reason"] == "length" for c in both["choices"])
        refused = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "logprobs": 2})
        assert refused.status_code == 400 and "log-probabilities" in refused.json()["error"]["message"]
        assert client.get("/v1/models").json()["data"][0]["max_model_len"] == 64
