"""verispec.batch.row_loop: targets whose caches hold one sequence (transformers-backed, compressed attention)
decode in BatchEngine row by row, each request with the tokens SpecEngine gives it alone."""

from __future__ import annotations

import pytest
import torch

from verispec.batch import BatchEngine, BatchRequest
from verispec.batch.row_loop import RowCaches, RowLoop
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.loading import build_engine, load_pair
from verispec.testing import make_byte_tokenizer, make_compressed_checkpoint

PROMPTS = [[5, 9, 33], [70, 71, 72, 73, 74], [2], [40, 41]]


@pytest.fixture(scope="module")
def unbatched(tmp_path_factory, byte_pair):
    """name -> a pair whose target does not batch: the byte pair through transformers, and a compressed-attention
    target with the byte pair's draft."""
    root = tmp_path_factory.mktemp("compressed-target")
    make_compressed_checkpoint(root, make_byte_tokenizer(root), seed=3)
    return {"hf": load_pair(*byte_pair, backend="hf"), "compressed": load_pair(root, byte_pair[1])}


@pytest.mark.parametrize("name", ["hf", "compressed"])
@pytest.mark.parametrize("spec", [SpecConfig(gamma=3), SpecConfig(method="tree", tree="s2_k2_d4"),
                                  SpecConfig(method="tree", tree="dynamic:6"), SpecConfig(gamma=2, drafter="ngram"),
                                  SpecConfig(method="none")], ids=["chain", "tree", "dynamic", "ngram", "off"])
def test_rows_of_a_one_sequence_model_decode_as_each_request_alone(unbatched, name, spec):
    pair = unbatched[name]
    if spec.method == "tree" and spec.tree_shape.dynamic and not pair.draft.capabilities.staged_trees:
        pytest.skip("this pair's draft cannot stage dynamic trees (refused up front by check_backend_supports)")
    assert not pair.target.capabilities.batching
    engine = BatchEngine(pair.target, pair.draft, spec, max_batch=3, max_len=64)
    assert isinstance(engine.target, RowLoop) and isinstance(engine.cache, RowCaches)
    sampling = SamplingParams(temperature=1.0, top_k=12)
    stops = [StopRules(max_tokens=8 + 3 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    pending = [BatchRequest(str(i), p, sampling, s, seed=i) for i, (p, s) in enumerate(zip(PROMPTS, stops))]
    tokens: dict[str, list[int]] = {r.request_id: [] for r in pending}
    most = 0
    while pending or engine.active:
        while pending and engine.has_capacity:  # 4 requests through 3 rows: one joins as another leaves
            events = engine.add(pending.pop(0))
            for event in events:
                tokens[event.request_id] += event.tokens
        most = max(most, engine.active)
        for event in engine.step():
            tokens[event.request_id] += event.tokens
    assert most == 3
    for i, (prompt, stop) in enumerate(zip(PROMPTS, stops)):
        alone = build_engine(pair, spec).generate(prompt, sampling, spec, stop, seed=i)
        assert tokens[str(i)] == alone.tokens, f"request {i}"


def test_row_caches_keep_each_rows_length_and_move_rows_by_swapping(unbatched):
    model = unbatched["compressed"].target
    loop = RowLoop.wrap(model)
    assert isinstance(loop, RowLoop) and loop.capabilities.batching and RowLoop.wrap(loop) is loop
    cache = loop.new_cache(3, 32)
    tokens = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0], [11, 0, 0, 0]])
    logits = loop.forward(tokens, cache.prefix_view(3), widths=[4, 2, 1])
    assert logits.shape == (3, 4, model.config.vocab_size)
    assert torch.equal(logits[1, 2:], torch.zeros_like(logits[1, 2:]))  # padding is not computed
    alone = model.forward(tokens[1:2, :2], model.new_cache(1, 32))
    assert torch.equal(logits[1:2, :2], alone)
    for row, width in enumerate([4, 2, 1]):
        cache.commit(row, width)
    assert cache.lengths == [4, 2, 1]
    first = cache.caches[0]
    cache.move_row(2, 0)
    assert cache.lengths[0] == 1 and cache.caches[2] is first
    cache.set_length(1, 1)
    assert cache.lengths == [1, 1, 4]


@pytest.mark.parametrize("name", ["hf", "compressed"])
def test_the_server_batches_a_target_that_keeps_one_sequence_per_cache(unbatched, name):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")  # starlette's TestClient
    from fastapi.testclient import TestClient

    from verispec.server.app import create_app
    from verispec.server.scheduler import ServerConfig

    pair, spec = unbatched[name], SpecConfig(gamma=3)
    app = create_app(pair, spec, ServerConfig(max_batch=8, max_model_len=64), model_name=name)
    assert app.state.scheduler.config.max_batch == 8
    with TestClient(app) as client:
        for prompt in ["Hi", "The cat"]:
            answer = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                          "ignore_eos": True, "logprobs": 2}).json()
            ids = pair.tokenizer.encode(prompt, add_special_tokens=False)
            alone = build_engine(pair, spec).generate(ids, SamplingParams(temperature=0), spec,
                                                      StopRules(max_tokens=6, ignore_eos=True))
            choice = answer["choices"][0]
            assert choice["text"] == pair.tokenizer.decode(alone.tokens, skip_special_tokens=True)
            assert len(choice["logprobs"]["token_logprobs"]) == 6 and answer["usage"]["completion_tokens"] == 6
        both = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 5, "n": 2, "seed": 4,
                                                    "temperature": 1.0, "ignore_eos": True}).json()
        assert sorted(c["index"] for c in both["choices"]) == [0, 1]
        assert all(c["finish_reason"] == "length" for c in both["choices"])
        assert client.get("/v1/models").json()["data"][0]["max_model_len"] == 64
