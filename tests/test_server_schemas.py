"""verispec.server.schemas: OpenAI request bodies, error bodies and the response builders."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")

from pydantic import ValidationError  # noqa: E402

from verispec.server.schemas import (ApiError, ChatCompletionRequest, CompletionRequest, chat_chunk,  # noqa: E402
                                     completion_choice, usage, usage_chunk)


def test_an_api_error_is_openais_error_body():
    err = ApiError(400, "n must be in 1..16", param="n")
    assert err.status == 400 and str(err) == "n must be in 1..16"
    assert err.body() == {"error": {"message": "n must be in 1..16", "type": "invalid_request_error", "param": "n",
                                    "code": None}}


def test_fields_set_to_something_unsupported_are_named():
    assert CompletionRequest(prompt="x").unsupported() == []
    assert CompletionRequest(prompt="x", echo=True, best_of=2, logit_bias={"1": 2.0}).unsupported() == \
        ["logit_bias", "echo", "best_of"]
    assert CompletionRequest(prompt="x", best_of=1).unsupported() == []
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[{"type": "function"}])
    assert chat.unsupported() == ["tools"]


def test_message_text_joins_its_parts_and_types_are_strict():
    message = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                            {"type": "text", "text": "b"}]}]).messages[0]
    assert message.text() == "ab"
    assert ChatCompletionRequest(messages=[{"role": "assistant"}]).messages[0].text() == ""
    with pytest.raises(ValidationError):
        CompletionRequest(prompt="x", temperature=float("inf"))
    with pytest.raises(ValidationError):
        CompletionRequest(prompt="x", stop_token_ids=["3"])  # ids are integers, not strings of them
    assert CompletionRequest(prompt="x", unknown_field=1).prompt == "x"  # unknown fields are ignored


def test_usage_and_builders():
    assert usage(3, 4) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert usage(3, 4, (2, 1))["completion_tokens_details"] == {"accepted_prediction_tokens": 2,
                                                                "rejected_prediction_tokens": 1}
    assert completion_choice(1, "hi", "stop") == {"index": 1, "text": "hi", "logprobs": None, "finish_reason": "stop"}
    assert completion_choice(0, "", "length", spec_stats={"rounds": 2})["spec_stats"] == {"rounds": 2}
    chunk = chat_chunk("id", "m", {"content": "x"}, index=2)
    assert chunk["object"] == "chat.completion.chunk" and chunk["choices"][0]["index"] == 2
    assert "spec_stats" not in chunk
    last = usage_chunk("id", "m", chat=False, usage_=usage(1, 1))
    assert last["choices"] == [] and last["object"] == "text_completion" and last["usage"]["total_tokens"] == 2
