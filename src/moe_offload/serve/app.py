"""The HTTP face: a FastAPI app over one `Engine`.

    GET  /health               200 {"status": "ok"} while the decoding thread runs, else 503
    GET  /metrics              Prometheus text (metrics.py)
    GET  /v1/models            the served model
    POST /v1/completions       prompt -> text          } "stream": true: server-sent events, the OpenAI
    POST /v1/chat/completions  messages -> message     } chunk format, ending `data: [DONE]`

Every refusal is the OpenAI error object with a 4xx (5xx for a failure of ours): malformed JSON, a wrong
model name, a bad or unsupported parameter (protocol.py), a missing chat template, a wrong API key (401),
a full queue (429, at once). A streamed request's HTTP status is decided before its first byte: the request
has its slot and its first token by then, so a full queue is a 429, never a stream that breaks.
"""


import json
import time

from .engine import Engine, QueueFull
from .protocol import ApiError, check_request, chunk, models_body, new_id, parse_body, response


def _prompt_ids(tokenizer):
    def encode(body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return tokenizer(prompt)["input_ids"]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = len(tokenizer)
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ApiError(400, f"prompt token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})",
                               param="prompt")
            return list(prompt)
        raise ApiError(400, f"`prompt` is {str(prompt)[:60]!r}: give one string (or one list of token ids); "
                            "several prompts go in several requests", param="prompt")
    return encode


def _chat_ids(tokenizer):
    def encode(body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "`messages` must be a non-empty list of {\"role\": ..., \"content\": ...}",
                           param="messages")
        plain = []
        for i, msg in enumerate(messages):
            content = msg.get("content") if isinstance(msg, dict) else None
            if isinstance(content, list):   # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                    raise ApiError(400, f"messages[{i}]: only text content parts are supported", param="messages")
                content = "".join(p.get("text", "") for p in content)
            if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(content, str):
                raise ApiError(400, f"messages[{i}] is {str(msg)[:60]!r}: each message needs a string `role` and a "
                                    "string `content`", param="messages")
            plain.append({"role": msg["role"], "content": content})
        if not getattr(tokenizer, "chat_template", None):
            raise ApiError(400, "this model's tokenizer has no chat template, so messages cannot be turned into a "
                                "prompt; use /v1/completions, or start the server with --chat-template FILE",
                           param="messages", code="no_chat_template")
        ids = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):   # a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    return encode


def build_app(engine: Engine, tokenizer, *, served_name: str, context: int, api_key: str | None = None,
              metrics=None):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    class ClosingStream(StreamingResponse):
        """A stream whose body is closed as soon as the response ends, a client's disconnect included: Starlette
        then cancels the send while the body generator waits at a `yield`, and would leave closing it (which frees
        the request's slot in the engine) to the garbage collector."""

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                await self.body_iterator.aclose()

    app = FastAPI(title="moe-offload", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())
    encoders = {"completion": _prompt_ids(tokenizer), "chat": _chat_ids(tokenizer)}

    def refuse(exc: ApiError) -> JSONResponse:
        if metrics is not None:
            metrics.answered(str(exc.status))
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(ApiError)
    async def _api_error(_request, exc: ApiError):
        return refuse(exc)

    @app.exception_handler(HTTPException)
    async def _http_error(_request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return refuse(ApiError(exc.status_code, f"{exc.detail}: this server has GET /health, /metrics, /v1/models "
                                                "and POST /v1/completions, /v1/chat/completions", code=code))

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return refuse(ApiError(401, "missing or wrong API key: send the key the server was started with "
                                            "(--api-key) as `Authorization: Bearer KEY`", code="invalid_api_key"))
        return await call_next(request)

    @app.get("/health")
    async def health():
        why = engine.alive
        if why is not None:
            return JSONResponse({"status": "unhealthy", "reason": why}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_text():
        if metrics is None:
            return PlainTextResponse("", status_code=404)
        body, ctype = metrics.text()
        return Response(body, media_type=ctype)

    @app.get("/v1/models")
    async def models():
        return models_body(served_name, created)

    async def complete(request: Request, kind: str):
        body = parse_body(await request.body())
        req = check_request(body, kind, served_name=served_name, encode=encoders[kind], context=context)
        rid = new_id(kind)
        events = engine.generate(req)
        try:
            first = await events.__anext__()   # the slot, the prefill and the first token (or the refusal)
        except QueueFull as exc:
            raise ApiError(429, f"the server is full: {exc}", type="rate_limit_error", code="queue_full") from None
        if not req.stream:
            text, last = first.text, first
            async for ev in events:
                text, last = text + ev.text, ev
            if metrics is not None:
                metrics.answered("200", len(req.prompt_ids), last.completion_tokens)
            return response(req, rid, served_name, text, last.finish, last.completion_tokens)
        return ClosingStream(_sse(req, rid, first, events), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})

    async def _sse(req, rid, first, events):
        status, last, ok = "cancelled", first, False
        try:
            if req.kind == "chat":   # the first chunk names the role
                yield chunk(req, rid, served_name, "", None, first=True)
            ev = first
            while True:
                if ev.text or ev.finish:
                    yield chunk(req, rid, served_name, ev.text, ev.finish)
                last = ev
                if ev.finish:
                    break
                ev = await events.__anext__()
            if req.include_usage:
                yield chunk(req, rid, served_name, None, None, usage=(len(req.prompt_ids), last.completion_tokens))
            yield "data: [DONE]\n\n"
            status, ok = "200", True
        except ApiError as exc:
            status = str(exc.status)
            yield f"data: {json.dumps(exc.body())}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await events.aclose()
            if metrics is not None:
                metrics.answered(status, len(req.prompt_ids), last.completion_tokens if ok else 0)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, "chat")

    return app
