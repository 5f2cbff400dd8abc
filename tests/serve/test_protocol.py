"""serve/protocol.py without a model: request bodies checked into a TextRequest or refused with the OpenAI error
object (status, type, param, code, and a message that names the fix), and response bodies and stream chunks
that the `openai` package's own types accept."""

from __future__ import annotations

import json

import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from moe_offload.serve.protocol import (DEFAULT_MAX_TOKENS, ApiError, TextRequest, check_request, chunk, models_body,
                                        parse_body, response)

NAME, CONTEXT = "tiny", 32


def encode(body: dict) -> list[int]:
    """A stand-in tokenizer: one token per character of the prompt (or of the messages' contents)."""
    if "messages" in body:
        return [ord(c) % 97 for m in body["messages"] for c in m["content"]]
    return [ord(c) % 97 for c in body["prompt"]]


def check(kind: str = "completion", **fields) -> TextRequest:
    body = {"model": NAME, **({"prompt": "Hello"} if kind == "completion" else
                              {"messages": [{"role": "user", "content": "Hi"}]}), **fields}
    return check_request(body, kind, served_name=NAME, encode=encode, context=CONTEXT)


def refused(kind: str = "completion", **fields) -> ApiError:
    with pytest.raises(ApiError) as info:
        check(kind, **fields)
    return info.value


# --- the body --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("raw", [b'{"model": "tiny", "prompt": ', b"not json", b"\xff\xfe", b""])
def test_malformed_json_is_a_400_saying_to_send_one_json_object(raw):
    with pytest.raises(ApiError) as info:
        parse_body(raw)
    err = info.value
    assert (err.status, err.type, err.code) == (400, "invalid_request_error", "invalid_json")
    assert "not valid JSON" in err.message and "send one JSON object" in err.message


@pytest.mark.parametrize("raw, kind", [(b"[1, 2]", "list"), (b'"hello"', "str"), (b"3", "int"), (b"null", "NoneType")])
def test_a_body_that_is_not_an_object_is_refused_naming_what_it_is(raw, kind):
    with pytest.raises(ApiError) as info:
        parse_body(raw)
    assert info.value.status == 400 and info.value.code == "invalid_json"
    assert f"JSON {kind}, not an object" in info.value.message


def test_a_json_object_parses_to_itself():
    assert parse_body(b'{"model": "tiny", "prompt": "x"}') == {"model": "tiny", "prompt": "x"}


def test_the_error_object_has_the_four_openai_fields():
    err = refused(model="other")
    assert err.body() == {"error": {"message": err.message, "type": "invalid_request_error", "param": "model",
                                    "code": "model_not_found"}}
    assert set(ApiError(400, "m").body()["error"]) == {"message", "type", "param", "code"}


# --- the model, the lengths ----------------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["other", None, "TINY", 3])
def test_a_wrong_model_name_is_a_404_naming_the_served_model(model):
    err = refused(model=model)
    assert (err.status, err.param, err.code) == (404, "model", "model_not_found")
    assert "'tiny'" in err.message and "/v1/models" in err.message


@pytest.mark.parametrize("value", [0, -3, 1.5, True, "8"])
def test_max_tokens_must_be_a_whole_number_of_at_least_one(value):
    err = refused(max_tokens=value)
    assert (err.status, err.param) == (400, "max_tokens")
    assert "give an integer of at least 1" in err.message and json.dumps(value) in err.message


def test_max_tokens_past_the_context_is_refused_saying_how_many_fit():
    room = CONTEXT - len("Hello")
    assert check(max_tokens=room).max_tokens == room
    err = refused(max_tokens=room + 1)
    assert (err.status, err.param, err.code) == (400, "max_tokens", "context_length_exceeded")
    assert f"ask for at most {room}" in err.message and f"context of {CONTEXT}" in err.message


def test_max_completion_tokens_is_checked_under_its_own_name():
    assert check("chat", max_completion_tokens=3).max_tokens == 3
    err = refused("chat", max_completion_tokens=CONTEXT)
    assert err.param == "max_completion_tokens" and err.code == "context_length_exceeded"


@pytest.mark.parametrize("length", [CONTEXT, CONTEXT + 5])
def test_a_prompt_that_fills_the_context_is_refused_saying_to_shorten_it(length):
    err = refused(prompt="a" * length)
    assert (err.status, err.param, err.code) == (400, "prompt", "context_length_exceeded")
    assert f"the prompt is {length} tokens" in err.message and "shorten the prompt" in err.message


def test_one_token_of_room_is_enough():
    req = check(prompt="a" * (CONTEXT - 1))
    assert req.max_tokens == 1 and len(req.prompt_ids) == CONTEXT - 1


def test_an_empty_prompt_is_refused():
    err = refused(prompt="")
    assert err.param == "prompt" and "no tokens" in err.message


# --- parameters not honoured -------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 5, 0])
def test_more_than_one_choice_is_refused_saying_to_send_n_requests(n):
    err = refused(n=n)
    assert (err.status, err.param, err.code) == (400, "n", "unsupported_parameter")
    assert "send n=1" in err.message
    assert check(n=1).max_tokens == DEFAULT_MAX_TOKENS


@pytest.mark.parametrize("kind, field, value", [("chat", "logprobs", True), ("completion", "logprobs", 5),
                                                 ("chat", "top_logprobs", 2)])
def test_logprobs_are_refused(kind, field, value):
    err = refused(kind, **{field: value})
    assert (err.status, err.param, err.code) == (400, field, "unsupported_parameter")
    assert "leave it out" in err.message


def test_logprobs_off_is_accepted():
    assert check("chat", logprobs=False, top_logprobs=0).kind == "chat"


@pytest.mark.parametrize("field, value", [("tools", [{"type": "function", "function": {"name": "f"}}]),
                                          ("functions", [{"name": "f"}]), ("tool_choice", "auto"),
                                          ("frequency_penalty", 0.5), ("response_format", {"type": "json_object"})])
def test_parameters_that_would_change_the_output_are_refused(field, value):
    err = refused("chat", **{field: value})
    assert (err.status, err.param, err.code) == (400, field, "unsupported_parameter")
    assert "not supported by this server" in err.message and "leave it out" in err.message


def test_an_unknown_parameter_is_refused_listing_what_is_taken():
    err = refused(temprature=0)
    assert (err.status, err.param, err.code) == (400, "temprature", "unknown_parameter")
    assert "unknown parameter `temprature`" in err.message and "temperature" in err.message.split(";")[1]


def test_neutral_parameters_that_clients_send_are_accepted():
    req = check("chat", user="someone", frequency_penalty=0, presence_penalty=0, logit_bias=None, store=False,
                tool_choice="none", response_format={"type": "text"}, metadata=None)
    assert req.kind == "chat" and req.prompt_ids == tuple(encode({"messages": [{"content": "Hi"}]}))


# --- sampling parameters ---------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, says", [
    ("temperature", "hot", "a number from 0 to 2"), ("temperature", -0.1, "a number from 0 to 2"),
    ("temperature", 2.5, "a number from 0 to 2"), ("temperature", True, "a number from 0 to 2"),
    ("top_p", 1.5, "a number from 0 to 1"), ("top_p", "x", "a number from 0 to 1"),
    ("seed", 1.5, "an integer"), ("seed", "5", "an integer"),
    ("stop", 5, "a non-empty string or a list of 1 to 4"), ("stop", [], "a non-empty string or a list"),
    ("stop", ["a", ""], "non-empty strings"), ("stop", ["a"] * 5, "1 to 4"), ("stop", [1], "non-empty strings"),
    ("stream", "yes", "give true or false"), ("ignore_eos", 1, "give true or false"),
    ("stream_options", {"include_usage": True, "x": 1}, "include_usage"),
])
def test_a_bad_sampling_parameter_is_a_400_naming_it_and_the_range(field, value, says):
    err = refused(**{field: value})
    assert (err.status, err.param, err.type) == (400, field, "invalid_request_error")
    assert says in err.message


def test_defaults_and_accepted_values_are_carried():
    req = check()
    assert (req.max_tokens, req.temperature, req.top_p, req.seed, req.stop, req.stream, req.ignore_eos) == \
        (DEFAULT_MAX_TOKENS, 1.0, 1.0, None, (), False, False)
    assert not req.greedy   # OpenAI's default temperature is 1: sampled
    assert check("chat").max_tokens == CONTEXT - 2   # chat: the room left by default
    req = check(temperature=0, top_p=0.5, seed=-7, stop="\n", stream=True, stream_options={"include_usage": True},
                ignore_eos=True, max_tokens=4)
    assert (req.greedy, req.top_p, req.seed, req.stop, req.stream, req.include_usage, req.ignore_eos,
            req.max_tokens) == (True, 0.5, -7, ("\n",), True, True, True, 4)
    assert check(stop=["a", "bc"]).stop == ("a", "bc")
    assert check(temperature=0.8, seed=5).temperature == 0.8


def test_the_encoder_s_refusal_passes_through():
    def bad(_body):
        raise ApiError(400, "no", param="prompt")

    with pytest.raises(ApiError, match="no"):
        check_request({"model": NAME, "prompt": 3}, "completion", served_name=NAME, encode=bad, context=CONTEXT)


# --- responses and chunks ----------------------------------------------------------------------------------

def _req(kind: str, **fields) -> TextRequest:
    return check(kind, temperature=0, max_tokens=5, **fields)


def test_a_completion_response_is_an_openai_completion():
    body = response(_req("completion"), "cmpl-1", NAME, " there", "length", 5)
    got = Completion.model_validate(body)
    assert (got.id, got.object, got.model) == ("cmpl-1", "text_completion", NAME)
    assert (got.choices[0].text, got.choices[0].finish_reason, got.choices[0].index) == (" there", "length", 0)
    assert (got.usage.prompt_tokens, got.usage.completion_tokens, got.usage.total_tokens) == (5, 5, 10)
    assert json.loads(json.dumps(body)) == body   # plain JSON


def test_a_chat_response_is_an_openai_chat_completion():
    body = response(_req("chat"), "chatcmpl-1", NAME, "Hello", "stop", 2)
    got = ChatCompletion.model_validate(body)
    assert got.object == "chat.completion" and got.choices[0].message.role == "assistant"
    assert (got.choices[0].message.content, got.choices[0].finish_reason) == ("Hello", "stop")
    assert (got.usage.prompt_tokens, got.usage.completion_tokens, got.usage.total_tokens) == (2, 2, 4)


def _event(line: str) -> dict:
    assert line.startswith("data: ") and line.endswith("\n\n") and line.count("\n") == 2, repr(line)
    return json.loads(line[len("data: "):-2])


def test_chat_chunks_are_server_sent_openai_chat_completion_chunks():
    req = _req("chat", stream=True, stream_options={"include_usage": True})
    first = ChatCompletionChunk.model_validate(_event(chunk(req, "c1", NAME, "", None, first=True)))
    assert first.choices[0].delta.role == "assistant" and first.choices[0].finish_reason is None
    mid = ChatCompletionChunk.model_validate(_event(chunk(req, "c1", NAME, "Hel", None)))
    assert (mid.choices[0].delta.content, mid.choices[0].finish_reason, mid.object) == ("Hel", None,
                                                                                         "chat.completion.chunk")
    assert mid.choices[0].delta.role is None
    last = ChatCompletionChunk.model_validate(_event(chunk(req, "c1", NAME, "lo", "length")))
    assert last.choices[0].finish_reason == "length" and last.id == "c1"
    usage = ChatCompletionChunk.model_validate(_event(chunk(req, "c1", NAME, None, None, usage=(2, 5))))
    assert usage.choices == [] and (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (2, 5)


def test_completion_chunks_are_server_sent_openai_completions():
    req = _req("completion", stream=True)
    mid = _event(chunk(req, "c2", NAME, "ab", None))
    assert mid["object"] == "text_completion" and mid["choices"][0] == {"index": 0, "text": "ab",
                                                                         "finish_reason": None, "logprobs": None}
    # the OpenAI type says a finish reason (a literal): the streamed chunks before the last carry null, as OpenAI's
    assert set(mid) <= set(Completion.model_fields)
    last = Completion.model_validate(_event(chunk(req, "c2", NAME, "c", "stop")))
    assert (last.choices[0].text, last.choices[0].finish_reason) == ("c", "stop")
    usage = Completion.model_validate(_event(chunk(req, "c2", NAME, None, None, usage=(5, 3))))
    assert usage.choices == [] and usage.usage.total_tokens == 8


def test_the_models_list_holds_the_served_model():
    body = models_body(NAME, 1700000000)
    assert body["object"] == "list" and len(body["data"]) == 1
    got = Model.model_validate(body["data"][0])
    assert (got.id, got.object, got.created, got.owned_by) == (NAME, "model", 1700000000, "moe-offload")
