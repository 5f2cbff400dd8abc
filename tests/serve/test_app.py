"""The server over HTTP: a real uvicorn server in a thread (serve.server.make_server on an ephemeral port),
talked to with the `openai` client and with raw HTTP. Endpoints, greedy output equal to `model.generate`,
chat templates, the OpenAI error object, the API key, a full server's 429, a disconnect freeing its slot, and
/metrics figures that match the requests made and the runtime's own accounting."""

from __future__ import annotations

import http.client as httpc
import json
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from fixtures_serve import (CHAT_TEMPLATE, EXPERT_BYTES, MIN_MARGIN, PROMPTS, budgets, families, folder,  # noqa: F401
                            http, load, metrics, reference, serving, tokenizer)
import moe_offload as mo
from moe_offload.planning.placement import GiB

NEW = 10
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a ship"}]


def client(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


def greedy(**extra) -> dict:
    return dict(model="tiny", max_tokens=NEW, temperature=0, extra_body={"ignore_eos": True}, **extra)


@pytest.fixture(scope="module")
def main(folder):
    """(live server, tokenizer with a chat template, greedy references): uva arm, 4 sequences together. The
    references (completion of each prompt, the chat prompt) come from plain generate before the server starts."""
    tok = tokenizer(folder)
    tok.chat_template = CHAT_TEMPLATE
    model, plan = load(folder, "uva")
    refs = {p: reference(model, tok(p)["input_ids"], NEW) for p in PROMPTS}
    chat_ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    chat_ids = list(chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids)
    refs["chat"] = reference(model, chat_ids, NEW)
    assert min(r.margin for r in refs.values()) > MIN_MARGIN
    with serving(model, plan, tok, max_concurrency=4, max_queue=8) as live:
        yield live, tok, refs


def text_of(tok, ref) -> str:
    return tok.decode(ref.tokens, skip_special_tokens=True)


# --- endpoints ---------------------------------------------------------------------------------------------

def test_health_and_models(main):
    live, _, _ = main
    status, _, raw = http(live.url + "/health")
    assert (status, json.loads(raw)) == (200, {"status": "ok"})
    listed = client(live.url).models.list()
    assert [m.id for m in listed.data] == ["tiny"] and listed.data[0].owned_by == "moe-offload"


def test_a_greedy_completion_equals_generate(main):
    live, tok, refs = main
    got = client(live.url).completions.create(prompt=PROMPTS[0], **greedy())
    assert got.choices[0].text == text_of(tok, refs[PROMPTS[0]])
    assert got.choices[0].finish_reason == "length" and got.model == "tiny" and got.object == "text_completion"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(tok(PROMPTS[0])["input_ids"]), NEW)


def test_greedy_completions_running_together_each_equal_generate(main):
    live, tok, refs = main
    c = client(live.url)
    with ThreadPoolExecutor(6) as pool:   # 6 requests on 4 slots: some wait in the queue
        got = list(pool.map(lambda p: c.completions.create(prompt=p, **greedy()).choices[0].text, PROMPTS[:6]))
    assert got == [text_of(tok, refs[p]) for p in PROMPTS[:6]]


def test_a_request_with_openais_default_temperature_is_sampled_and_completes(main):
    # no temperature sent: OpenAI's default is 1, so the request is sampled (by the sampler on the logits'
    # device); seeded, it draws the same text again, and that text is not the argmax's
    live, tok, refs = main
    c = client(live.url)
    ask = dict(model="tiny", prompt=PROMPTS[0], max_tokens=NEW, seed=3, extra_body={"ignore_eos": True})
    got = [c.completions.create(**ask) for _ in range(2)]
    assert [g.choices[0].finish_reason for g in got] == ["length"] * 2
    assert got[0].usage.completion_tokens == NEW and got[0].choices[0].text == got[1].choices[0].text
    assert got[0].choices[0].text != text_of(tok, refs[PROMPTS[0]])


def test_a_streamed_completion_is_the_same_text_in_chunks(main):
    live, tok, refs = main
    stream = client(live.url).completions.create(prompt=PROMPTS[2], stream=True,
                                                 stream_options={"include_usage": True}, **greedy())
    chunks = list(stream)
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == text_of(tok, refs[PROMPTS[2]])
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) <= {None} and len(finishes) > 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == NEW


def _sse(url: str, body: dict, headers: dict | None = None) -> tuple[int, str, list[str]]:
    """(status, content type, the data lines) of a streamed request read raw."""
    host, port = url.removeprefix("http://").split(":")
    conn = httpc.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json",
                                                                    **(headers or {})})
        resp = conn.getresponse()
        raw = resp.read().decode()
        return resp.status, resp.getheader("content-type"), raw.split("\n\n")
    finally:
        conn.close()


def test_a_raw_stream_is_server_sent_events_ending_done(main):
    live, tok, refs = main
    status, ctype, events = _sse(live.url, {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": NEW,
                                            "temperature": 0, "ignore_eos": True, "stream": True})
    assert status == 200 and ctype.startswith("text/event-stream")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events[:-1])
    bodies = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert "".join(b["choices"][0]["text"] for b in bodies) == text_of(tok, refs[PROMPTS[1]])
    last = openai.types.Completion.model_validate(bodies[-1])   # the last chunk names its finish
    assert last.choices[0].finish_reason == "length" and last.model == "tiny"


def test_a_chat_completion_uses_the_chat_template(main):
    live, tok, refs = main
    c = client(live.url)
    got = c.chat.completions.create(messages=MESSAGES, **greedy())
    want = text_of(tok, refs["chat"])
    assert got.choices[0].message.content == want and got.choices[0].message.role == "assistant"
    assert got.object == "chat.completion" and got.usage.completion_tokens == NEW
    chunks = list(c.chat.completions.create(messages=MESSAGES, stream=True, **greedy()))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_without_a_chat_template_is_a_400_saying_how_to_give_one(main, monkeypatch):
    live, tok, _ = main
    monkeypatch.setattr(tok, "chat_template", None)
    with pytest.raises(openai.BadRequestError) as info:
        client(live.url).chat.completions.create(messages=MESSAGES, **greedy())
    err = info.value
    assert (err.status_code, err.code, err.param) == (400, "no_chat_template", "messages")
    assert "--chat-template FILE" in err.message and "/v1/completions" in err.message


# --- the error object -------------------------------------------------------------------------------------

def _error(status: int, raw: bytes) -> dict:
    body = json.loads(raw)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_malformed_json_is_the_openai_error_object(main):
    live, _, _ = main
    status, headers, raw = http(live.url + "/v1/completions", method="POST", body=b'{"model": "tiny", "prompt"')
    err = _error(status, raw)
    assert status == 400 and headers["content-type"] == "application/json"
    assert (err["type"], err["code"]) == ("invalid_request_error", "invalid_json") and "JSON" in err["message"]


def test_a_wrong_model_is_a_404_model_not_found(main):
    live, _, _ = main
    with pytest.raises(openai.NotFoundError) as info:
        client(live.url).completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert (info.value.code, info.value.param) == ("model_not_found", "model") and "'tiny'" in info.value.message
    status, _, raw = http(live.url + "/v1/chat/completions", method="POST",
                          body={"model": "gpt-4", "messages": MESSAGES})
    assert status == 404 and _error(status, raw)["code"] == "model_not_found"


def test_n_above_one_is_a_400_unsupported_parameter(main):
    live, _, _ = main
    with pytest.raises(openai.BadRequestError) as info:
        client(live.url).completions.create(model="tiny", prompt="x", max_tokens=2, n=2)
    assert (info.value.code, info.value.param) == ("unsupported_parameter", "n")


def test_an_unknown_route_is_a_404_error_object_listing_the_routes(main):
    live, _, _ = main
    status, _, raw = http(live.url + "/v1/embeddings", method="POST", body={"model": "tiny", "input": "x"})
    err = _error(status, raw)
    assert status == 404 and err["code"] == "not_found" and "/v1/completions" in err["message"]


def test_a_wrong_method_is_a_405_error_object(main):
    live, _, _ = main
    status, _, raw = http(live.url + "/v1/completions")          # GET on a POST route
    err = _error(status, raw)
    assert status == 405 and err["code"] == "method_not_allowed" and "POST /v1/completions" in err["message"]


# --- the API key ------------------------------------------------------------------------------------------

def test_an_api_key_guards_v1_and_leaves_health_open(folder):
    model, plan = load(folder, "uva")
    with serving(model, plan, tokenizer(folder), api_key="sekret", max_concurrency=2) as live:
        for key in ("none", "sekret2"):
            with pytest.raises(openai.AuthenticationError) as info:
                client(live.url, key).completions.create(prompt="x", **greedy())
            assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
            assert "Authorization: Bearer KEY" in info.value.message
        status, _, raw = http(live.url + "/v1/models")
        assert status == 401 and _error(status, raw)["code"] == "invalid_api_key"
        got = client(live.url, "sekret").completions.create(prompt="x", **greedy())
        assert got.usage.completion_tokens == NEW
        status, _, _ = http(live.url + "/v1/models", headers={"Authorization": "Bearer sekret"})
        assert status == 200
        assert http(live.url + "/health")[0] == 200 and http(live.url + "/metrics")[0] == 200
        m = metrics(live.url)
        assert m[("moe_offload_requests_total", (("status", "401"),))] == 3
        assert m[("moe_offload_requests_total", (("status", "200"),))] == 1


# --- a full server, a disconnect ---------------------------------------------------------------------------

STEP_S = 0.02    # a slowed decode step: a long request outlasts every bound below by far
LONG = 240       # tokens of the long request: >= 4.8 s of decoding


@pytest.fixture(scope="module")
def full(folder):
    """A server of one slot and no queue on a model slowed to STEP_S per forward call."""
    model, plan = load(folder, "uva")
    handle = model.register_forward_hook(lambda *_: time.sleep(STEP_S))
    try:
        with serving(model, plan, tokenizer(folder), max_concurrency=1, max_queue=0) as live:
            yield live
    finally:
        handle.remove()


class Stream:
    """A raw streaming request held open: read its first event, then close the connection (a disconnect)."""

    def __init__(self, url: str, max_tokens: int):
        host, port = url.removeprefix("http://").split(":")
        self.conn = httpc.HTTPConnection(host, int(port), timeout=30)
        self.conn.request("POST", "/v1/completions", json.dumps(
            {"model": "tiny", "prompt": "x", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
             "stream": True}), {"Content-Type": "application/json"})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200
        line = self.resp.readline()
        assert line.startswith(b"data: {"), line

    def close(self) -> None:
        self.resp.close()
        self.conn.close()


def _running(url: str) -> float:
    return metrics(url)[("moe_offload_sequences_running", ())]


def _until(predicate, seconds: float) -> float:
    """Seconds until predicate() held (polled); fails past `seconds`."""
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < seconds, f"not within {seconds} s"
        time.sleep(0.02)
    return time.monotonic() - t0


def _count(url: str, status: str) -> float:
    return metrics(url).get(("moe_offload_requests_total", (("status", status),)), 0.0)


def test_a_full_server_answers_429_at_once(full):
    before = _count(full.url, "429")
    held = Stream(full.url, LONG)
    try:
        assert _running(full.url) == 1
        t0 = time.monotonic()
        with pytest.raises(openai.RateLimitError) as info:
            client(full.url).completions.create(prompt="y", **greedy())
        assert time.monotonic() - t0 < 1.5   # not after the running request (LONG * STEP_S s)
        assert (info.value.status_code, info.value.code, info.value.type) == (429, "queue_full", "rate_limit_error")
        assert "--max-concurrency 1" in info.value.message and "retry later" in info.value.message
        assert _count(full.url, "429") == before + 1
    finally:
        held.close()
    _until(lambda: _running(full.url) == 0, 3)
    got = client(full.url).completions.create(prompt="y", model="tiny", max_tokens=3, temperature=0)
    assert got.usage.completion_tokens <= 3


def test_a_client_that_disconnects_mid_stream_frees_its_slot(full):
    cancelled = _count(full.url, "cancelled")
    held = Stream(full.url, LONG)
    held.resp.readline(), held.resp.readline()   # a few tokens in
    assert _running(full.url) == 1
    held.close()
    freed = _until(lambda: _running(full.url) == 0, 2.0)
    assert freed < LONG * STEP_S / 2
    _until(lambda: _count(full.url, "cancelled") == cancelled + 1, 2.0)
    steps = metrics(full.url)[("moe_offload_decode_steps_total", ())]
    time.sleep(10 * STEP_S)
    assert metrics(full.url)[("moe_offload_decode_steps_total", ())] - steps <= 2   # the sequence was cancelled
    got = client(full.url).completions.create(prompt="z", **greedy())
    assert got.usage.completion_tokens == NEW


# --- /metrics -------------------------------------------------------------------------------------------------

def _disk_and_cache(folder) -> dict:
    return dict(budgets(folder)["disk"], cache_gb=4 * EXPERT_BYTES / GiB, reserve_gb=1 + 5 * EXPERT_BYTES / GiB)


def test_metrics_match_the_requests_and_the_runtime_s_accounting(folder):
    tok = tokenizer(folder)
    ids = tok(PROMPTS[0])["input_ids"]
    # a fresh load's plain run of the first request: what the server's figures must equal after that request
    plain, plan = mo.load(folder, **_disk_and_cache(folder))
    ref = reference(plain, ids, NEW)
    rt = plain.moe_offload_runtime
    want = dict(link=rt.counter.decode_bytes_per_token() + rt.disk_counter.decode_bytes_per_token(),
                disk_bytes=rt.disk.bytes_read, disk_reads=rt.disk.read_calls, hits=rt.cache.policy.hits,
                misses=rt.cache.policy.misses)
    assert want["disk_bytes"] > 0 and want["hits"] > 0 and ref.margin > MIN_MARGIN
    model, plan = mo.load(folder, **_disk_and_cache(folder))
    with serving(model, plan, tok, max_concurrency=2) as live:
        c = client(live.url)
        got = c.completions.create(prompt=PROMPTS[0], **greedy())
        assert got.choices[0].text == text_of(tok, ref)
        m = metrics(live.url)
        assert m[("moe_offload_link_bytes_per_token", ())] == want["link"]
        assert m[("moe_offload_disk_read_bytes_total", ())] == want["disk_bytes"]
        assert m[("moe_offload_disk_reads_total", ())] == want["disk_reads"]
        assert m[("moe_offload_cache_hits_total", (("level", "device"),))] == want["hits"]
        assert m[("moe_offload_cache_misses_total", (("level", "device"),))] == want["misses"]
        assert m[("moe_offload_decode_steps_total", ())] == NEW - 1
        for tier in ("device", "host", "disk"):
            assert m[("moe_offload_plan_bytes", (("tier", tier),))] == sum(t.bytes for t in plan.tensors
                                                                            if t.tier == tier)
        assert m[("moe_offload_plan_bytes", (("tier", "disk"),))] > 0

        # more requests: a refused one, a streamed one
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model="other", prompt="x", max_tokens=2)
        short = 4
        list(c.completions.create(prompt=PROMPTS[1], stream=True, **{**greedy(), "max_tokens": short}))
        _until(lambda: _count(live.url, "200") == 2, 2.0)
        m = metrics(live.url)
        assert m[("moe_offload_requests_total", (("status", "404"),))] == 1
        prompt_tokens = len(ids) + len(tok(PROMPTS[1])["input_ids"])
        assert m[("moe_offload_tokens_total", (("kind", "prompt"),))] == prompt_tokens
        assert m[("moe_offload_tokens_total", (("kind", "completion"),))] == NEW + short
        assert m[("moe_offload_time_to_first_token_seconds_count", ())] == 2
        assert m[("moe_offload_inter_token_latency_seconds_count", ())] == (NEW - 1) + (short - 1)
        assert m[("moe_offload_time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == 2
        assert 0 < m[("moe_offload_time_to_first_token_seconds_sum", ())] < 30
        assert m[("moe_offload_sequences_running", ())] == 0 and m[("moe_offload_sequences_waiting", ())] == 0
        assert m[("moe_offload_link_bytes_per_token", ())] > 0
        kinds = families(live.url)
        assert kinds["moe_offload_time_to_first_token_seconds"] == "histogram"
        assert kinds["moe_offload_inter_token_latency_seconds"] == "histogram"
        assert kinds["moe_offload_requests"] == kinds["moe_offload_disk_read_bytes"] == "counter"
        assert kinds["moe_offload_cache_hits"] == "counter" and kinds["moe_offload_plan_bytes"] == "gauge"
        assert all(name.startswith("moe_offload_") for name in kinds)
