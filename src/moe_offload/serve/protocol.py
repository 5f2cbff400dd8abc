"""The OpenAI API as this server speaks it: a request body checked into a typed `TextRequest`, the
responses and stream chunks built from the `openai` package's own types, and the error object.

Checked here, before anything reaches the model: the body is a JSON object, `model` is the served name,
`max_tokens` >= 1 and prompt + max_tokens within the context, `temperature` / `top_p` / `seed` / `stop` of
the right types and ranges, and no parameter the server does not honour (`n` > 1, `logprobs`, `tools`,
an unknown name): each is an `ApiError` whose message says what, why and the fix. Parameters that clients
send by default and that change nothing here (`user`, `frequency_penalty: 0`, ...) are accepted.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

# OpenAI's defaults (temperature and top_p 1): a request that names neither is sampled, as OpenAI's are.
# The openai package's own types, imported once: `from openai.types import X` inside a function costs 0.15 ms
# a call (the package resolves its names lazily), and a chunk is built per token.
from openai.types import Completion, CompletionChoice, CompletionUsage, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice, ChoiceDelta

DEFAULT_TEMPERATURE = 1.0
DEFAULT_MAX_TOKENS = 16            # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 4               # as OpenAI

# Accepted and without effect here, at these values (a client library may send them as they are).
_NEUTRAL = {"user": None, "frequency_penalty": 0, "presence_penalty": 0, "logit_bias": None, "best_of": 1,
            "echo": False, "suffix": None, "parallel_tool_calls": None, "store": False, "metadata": None,
            "service_tier": None, "tool_choice": "none", "response_format": {"type": "text"}}
# Accepted at any value: free-form tags of the caller that never reach the model.
_ANY_VALUE = {"user", "metadata"}
_OURS = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
         "stop", "stream", "stream_options", "n", "ignore_eos", "logprobs", "top_logprobs"}


class ApiError(Exception):
    """A rejected request: HTTP status + the OpenAI error object's fields."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class TextRequest:
    """One completion request, checked: the prompt as token ids and how to continue it."""

    kind: str                       # "completion" or "chat"
    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float              # 0: greedy
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool             # stream_options.include_usage: a last chunk with the usage
    ignore_eos: bool                # an extension (as vLLM's): decode on past EOS, to max_tokens

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc}); send one JSON object, e.g. "
                            '{"model": "...", "prompt": "Hello", "max_tokens": 16}', code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body is a JSON {type(body).__name__}, not an object; send one JSON "
                            "object with the request's fields", code="invalid_json")
    return body


def _number(body: dict, name: str, default, lo: float, hi: float, *, integer: bool = False):
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not lo <= value <= hi:
        kind = "an integer" if integer else "a number"
        raise ApiError(400, f"`{name}` is {json.dumps(value)}: give {kind} from {lo:g} to {hi:g}", param=name)
    return value


def _check_params(body: dict) -> None:
    for name, value in body.items():
        if name in _OURS or name in _ANY_VALUE:
            continue
        if name in _NEUTRAL and value == _NEUTRAL[name] or name in _NEUTRAL and value is None:
            continue
        if name in _NEUTRAL or name in ("tools", "functions", "function_call"):
            raise ApiError(400, f"`{name}` = {json.dumps(value)[:60]} is not supported by this server (it would "
                                "change the output and is not implemented); leave it out", param=name,
                           code="unsupported_parameter")
        raise ApiError(400, f"unknown parameter `{name}`; this server takes model, prompt / messages, max_tokens, "
                            "temperature, top_p, seed, stop, stream, stream_options, n=1, ignore_eos", param=name,
                       code="unknown_parameter")
    if body.get("n", 1) != 1:
        raise ApiError(400, f"`n` = {json.dumps(body['n'])}: one choice per request only; send n=1 (or n times "
                            "the request, with distinct seeds)", param="n", code="unsupported_parameter")
    for name in ("logprobs", "top_logprobs"):
        if body.get(name) not in (None, False, 0):
            raise ApiError(400, f"`{name}` is not supported by this server (log-probabilities are not returned); "
                                "leave it out", param=name, code="unsupported_parameter")


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or not 1 <= len(stops) <= MAX_STOP_STRINGS
            or not all(isinstance(s, str) and s for s in stops)):
        raise ApiError(400, f"`stop` is {json.dumps(stop)[:80]}: give a non-empty string or a list of 1 to "
                            f"{MAX_STOP_STRINGS} non-empty strings", param="stop")
    return tuple(stops)


def check_request(body: dict, kind: str, *, served_name: str, encode, context: int) -> TextRequest:
    """`body` (a JSON object) as a TextRequest; `encode(body) -> list[int]` gives the prompt's token ids (and
    raises ApiError for a malformed prompt / messages); `context` the model's context length in tokens."""
    _check_params(body)
    model = body.get("model")
    if model != served_name:
        raise ApiError(404, f"model {json.dumps(model)} is not served here; this server serves {served_name!r} "
                            "(GET /v1/models lists it)", param="model", code="model_not_found")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, f"`stream` is {json.dumps(stream)}: give true or false", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise ApiError(400, f"`stream_options` is {json.dumps(options)[:60]}: only {{\"include_usage\": bool}} is "
                            "taken", param="stream_options")
    ids = encode(body)
    if not ids:
        raise ApiError(400, "the prompt encodes to no tokens: give non-empty text", param="prompt")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    room = context - len(ids)
    if room < 1:
        raise ApiError(400, f"the prompt is {len(ids)} tokens, the model's context {context}: nothing is left to "
                            "generate; shorten the prompt", param="prompt", code="context_length_exceeded")
    default = DEFAULT_MAX_TOKENS if kind == "completion" else room
    max_tokens = body.get(name)
    if max_tokens is None:
        max_tokens = default
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ApiError(400, f"`{name}` is {json.dumps(max_tokens)}: give an integer of at least 1", param=name)
    elif max_tokens > room:
        raise ApiError(400, f"`{name}` {max_tokens} + the prompt's {len(ids)} tokens = {max_tokens + len(ids)} is "
                            f"past the model's context of {context} tokens; ask for at most {room}", param=name,
                       code="context_length_exceeded")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ApiError(400, f"`ignore_eos` is {json.dumps(ignore_eos)}: give true or false", param="ignore_eos")
    return TextRequest(kind=kind, prompt_ids=tuple(ids), max_tokens=int(min(max_tokens, room)),
                       temperature=float(_number(body, "temperature", DEFAULT_TEMPERATURE, 0, 2)),
                       top_p=float(_number(body, "top_p", 1.0, 0, 1)),
                       seed=_number(body, "seed", None, -2**63, 2**63 - 1, integer=True),
                       stop=_stop(body), stream=stream, include_usage=bool(options.get("include_usage")),
                       ignore_eos=ignore_eos)


# --- responses --------------------------------------------------------------------------------

def new_id(kind: str) -> str:
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex[:24]


def _usage(prompt: int, completion: int):
    return CompletionUsage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def response(req: TextRequest, rid: str, model: str, text: str, finish: str, completion_tokens: int) -> dict:
    """The whole (non-streamed) response body."""
    usage = _usage(len(req.prompt_ids), completion_tokens)
    created = int(time.time())
    if req.kind == "completion":
        body = Completion(id=rid, object="text_completion", created=created, model=model, usage=usage,
                          choices=[CompletionChoice(index=0, text=text, finish_reason=finish, logprobs=None)])
    else:
        body = ChatCompletion(id=rid, object="chat.completion", created=created, model=model, usage=usage,
                              choices=[ChatChoice(index=0, finish_reason=finish, logprobs=None,
                                              message=ChatCompletionMessage(role="assistant", content=text))])
    return body.model_dump(mode="json")


def chunk(req: TextRequest, rid: str, model: str, text: str | None, finish: str | None, *, first: bool = False,
          usage: tuple[int, int] | None = None) -> str:
    """One server-sent event of a streamed response (`usage`: the last, choice-less chunk of include_usage)."""
    created = int(time.time())
    use = _usage(*usage) if usage is not None else None
    if req.kind == "completion":
        # A streamed completion's choice has finish_reason null until the last, which the type does not allow: the
        # chunk is built valid (with "length") and the field set after dumping (constructing it unvalidated instead
        # makes the dump ten times slower, and this runs once per token).
        choices = [] if usage is not None else [CompletionChoice(index=0, text=text or "", finish_reason="length",
                                                                 logprobs=None)]
        dumped = Completion(id=rid, object="text_completion", created=created, model=model, choices=choices,
                            usage=use).model_dump(mode="json")
        for c in dumped["choices"]:
            c["finish_reason"] = finish
        return f"data: {json.dumps(dumped)}\n\n"
    else:
        delta = ChoiceDelta(role="assistant" if first else None, content=text)
        choices = [] if usage is not None else [ChunkChoice(index=0, delta=delta, finish_reason=finish, logprobs=None)]
        body = ChatCompletionChunk(id=rid, object="chat.completion.chunk", created=created, model=model,
                                   choices=choices, usage=use)
    return f"data: {json.dumps(body.model_dump(mode='json'))}\n\n"


def models_body(name: str, created: int) -> dict:
    return {"object": "list", "data": [Model(id=name, object="model", created=created,
                                             owned_by="moe-offload").model_dump(mode="json")]}
