"""verispec.server.prepare: OpenAI request bodies -> the engine's BatchRequests, or a 400 saying why not."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")

from verispec.errors import ContextError  # noqa: E402
from verispec.loading import ModelPair, load_pair  # noqa: E402
from verispec.server.prepare import RequestBuilder  # noqa: E402
from verispec.server.schemas import ApiError, ChatCompletionRequest, CompletionRequest  # noqa: E402

MODEL = "target"  # the served model id: the target directory's name


@pytest.fixture(scope="module")
def pair(byte_pair) -> ModelPair:
    return load_pair(*byte_pair)


@pytest.fixture(scope="module")
def builder(pair) -> RequestBuilder:
    return RequestBuilder(pair.tokenizer, pair.target, MODEL, lambda request: None, 512)


def refused(call, body) -> ApiError:
    with pytest.raises(ApiError) as caught:
        call(body)
    assert caught.value.status == 400
    return caught.value


def test_chat_requests_also_stop_at_end_of_message(pair):
    builder = RequestBuilder(pair.tokenizer, pair.target, MODEL, lambda request: None, 512)
    end = pair.tokenizer.get_vocab()["<|end|>"]
    chat = builder.chat(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]))
    completion = builder.completion(CompletionRequest(prompt="hi"))
    assert end in chat.request.stop.eos_ids and end not in completion.request.stop.eos_ids
    assert pair.tokenizer.eos_token_id in completion.request.stop.eos_ids


def test_a_completion_becomes_one_request_per_choice_seeded_seed_plus_i(pair, builder):
    prepared = builder.completion(CompletionRequest(prompt="Hi", n=3, seed=40, temperature=1e-6, max_tokens=7))
    ids = pair.tokenizer.encode("Hi", add_special_tokens=False)
    assert [r.request_id for r in prepared.requests] == [f"{prepared.request_id}-{i}" for i in range(3)]
    assert prepared.request_id.startswith("cmpl-") and not prepared.chat
    assert [r.seed for r in prepared.requests] == [40, 41, 42]
    assert all(r.prompt_ids == ids and r.stop.max_tokens == 7 for r in prepared.requests)
    assert prepared.request.sampling.temperature == 0.0  # below 1e-5 is greedy
    single = builder.completion(CompletionRequest(prompt=[5, 6]))
    assert single.request.request_id == single.request_id and single.request.prompt_ids == [5, 6]
    assert single.request.stop.max_tokens == 16  # OpenAI's default


def test_stop_token_ids_join_eos_or_replace_it_under_ignore_eos(pair, builder):
    eos = pair.tokenizer.eos_token_id
    joined = builder.completion(CompletionRequest(prompt="a", stop_token_ids=[9, 9]))
    assert set(joined.request.stop.eos_ids) == {eos, 9} and joined.stop_token_ids == {9}
    alone = builder.completion(CompletionRequest(prompt="a", stop_token_ids=[9], ignore_eos=True))
    assert alone.request.stop.eos_ids == (9,) and not alone.request.stop.ignore_eos


def test_what_cannot_be_served_is_a_400_naming_the_field(pair, builder):
    vocab = pair.target.config.vocab_size
    assert refused(builder.completion, CompletionRequest(prompt="a", model="other")).code == "model_not_found"
    assert refused(builder.completion, CompletionRequest(prompt="a", n=0)).param == "n"
    error = refused(builder.completion, CompletionRequest(prompt=[1, vocab]))
    assert error.param == "prompt" and f"prompt token id {vocab} is outside the vocabulary" in error.message
    assert refused(builder.completion, CompletionRequest(prompt=["a", "b"])).param == "prompt"
    assert refused(builder.completion, CompletionRequest(prompt="a", echo=True)).param == "echo"
    assert refused(builder.completion, CompletionRequest(prompt="a", stop=[""])).param == "stop"
    assert refused(builder.completion, CompletionRequest(prompt="a", top_p=0.0)).param == "top_p"
    assert refused(builder.completion, CompletionRequest(prompt="a", logprobs=21)).param == "logprobs"
    assert refused(builder.completion, CompletionRequest(prompt="a", seed=2**64 - 1, n=2)).param == "seed"
    both = CompletionRequest(prompt="a", response_format={"type": "json_object"}, structured_outputs={"regex": "a"})
    assert refused(builder.completion, both).param == "structured_outputs"
    assert refused(builder.completion, CompletionRequest(prompt="a", prediction={"type": "x"})).param == "prediction"
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_logprobs=2)
    assert refused(builder.chat, chat).param == "top_logprobs"  # needs logprobs: true
    assert refused(builder.chat, ChatCompletionRequest(messages=[])).param == "messages"


def test_a_request_that_cannot_fit_the_context_says_what_to_do(pair):
    def check(request):
        raise ContextError("prompt + max_tokens is 600 tokens; the context holds 512")

    error = refused(RequestBuilder(pair.tokenizer, pair.target, MODEL, check, 512).completion,
                    CompletionRequest(prompt="a", max_tokens=599))
    assert error.code == "context_length_exceeded" and error.message.endswith("shorten the prompt or lower max_tokens")


def test_a_predicted_output_becomes_its_tokens(pair, builder):
    prediction = {"type": "content", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "c"}]}
    prepared = builder.completion(CompletionRequest(prompt="a", prediction=prediction))
    assert prepared.request.prediction == pair.tokenizer.encode("abc", add_special_tokens=False)
