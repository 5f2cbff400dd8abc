"""serve/engine.py driven directly with asyncio on a tiny qwen3_moe model: greedy tokens of concurrent requests
equal plain `model.generate` under every tier arm, the Meter's decode steps and bytes per token agree with the
runtime's own accounting of a single run, seeded sampling, stop strings, admission and cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from fixtures_serve import MIN_MARGIN, PROMPTS, folder, load, reference, tokenizer  # noqa: F401 (fixture)
from moe_offload.serve.engine import Engine, Event, Limits, QueueFull
from moe_offload.serve.metrics import Meter
from moe_offload.serve.protocol import check_request

NEW = 12            # tokens per request
CONTEXT = 128


def request(tok, prompt: str, max_tokens: int = NEW, **fields):
    """A checked completion request (greedy past EOS unless fields say otherwise)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **fields}
    return check_request(body, "completion", served_name="tiny", encode=lambda b: tok(b["prompt"])["input_ids"],
                         context=CONTEXT)


async def collect(engine: Engine, req) -> tuple[str, Event, int]:
    """(the text of every event joined, the last event, how many events)."""
    text, last, n = "", None, 0
    async for ev in engine.generate(req):
        text, last, n = text + ev.text, ev, n + 1
    return text, last, n


@contextlib.contextmanager
def started(model, tok, limits: Limits):
    """(a started engine, run(coroutine)): every coroutine runs on one event loop, as in the server (the
    manager delivers to the loop a request registered on)."""
    engine = Engine(model, tok, limits)
    engine.start()
    try:
        with asyncio.Runner() as runner:
            assert engine.alive is None
            yield engine, runner.run
    finally:
        engine.stop()


def limits(concurrency: int = 8, queue: int = 8) -> Limits:
    return Limits(max_concurrency=concurrency, max_queue=queue, context=CONTEXT, page_size=16)


# --- greedy tokens and bytes per token under every tier ----------------------------------------------------

@pytest.mark.parametrize("arm", ["uva", "prefetch", "cache", "disk"])
def test_concurrent_greedy_tokens_equal_generate_and_the_meter_agrees_with_a_single_run(folder, arm):
    tok = tokenizer(folder)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    assert len({len(i) for i in ids}) >= 6   # different prompt lengths
    # A fresh load's single plain run: the runtime's own per-token accounting (as `generate --json` reports it).
    plain, plan = load(folder, arm)
    refs = [reference(plain, ids[0], NEW)]
    rt = plain.moe_offload_runtime
    want = (rt.counter.decode_bytes_per_token(), rt.disk_counter.decode_bytes_per_token())
    assert want[0] > 0 and (want[1] > 0) == (arm == "disk")
    refs += [reference(plain, i, NEW) for i in ids[1:]]
    assert min(r.margin for r in refs) > MIN_MARGIN, [r.margin for r in refs]

    model, plan2 = load(folder, arm)   # a second fresh load with the same plan
    assert [(t.name, t.tier, t.host_expert_ids) for t in plan2.tensors] == \
        [(t.name, t.tier, t.host_expert_ids) for t in plan.tensors]
    meter = Meter(model)
    try:
        with started(model, tok, limits()) as (engine, run):
            text, last, _ = run(collect(engine, request(tok, PROMPTS[0])))
            assert last.token_ids == refs[0].tokens and last.finish == "length" and last.completion_tokens == NEW
            assert text == tok.decode(refs[0].tokens, skip_special_tokens=True)
            # one prefill call, then NEW - 1 decode steps of one token each
            assert (meter.decode_steps, meter.decode_tokens, meter.calls) == (NEW - 1, NEW - 1, NEW)
            assert meter.per_token() == want

            async def all_at_once():
                return await asyncio.gather(*(collect(engine, request(tok, p)) for p in PROMPTS))

            steps, tokens = meter.decode_steps, meter.decode_tokens
            results = run(all_at_once())
            assert engine.running == 0 and engine.waiting == 0
    finally:
        meter.close()
    for prompt, ref, (text, last, _) in zip(PROMPTS, refs, results):
        assert last.token_ids == ref.tokens, f"{arm}: {prompt!r}"
        assert (last.finish, last.completion_tokens) == ("length", NEW)
    # steps where every sequence adds one token: at least NEW - 1, none counting more tokens than sequences
    steps, tokens = meter.decode_steps - steps, meter.decode_tokens - tokens
    assert NEW - 1 <= steps <= len(PROMPTS) * (NEW - 1) and steps <= tokens <= len(PROMPTS) * (NEW - 1)
    assert tokens > steps   # the sequences were decoded together
    host, disk = meter.per_token()
    assert host > 0 and (disk > 0) == (arm == "disk")


# --- one engine shared by the behaviour tests ---------------------------------------------------------------

@pytest.fixture(scope="module")
def shared(folder):
    """(engine, run, tokenizer, meter, greedy references of PROMPTS) on the uva arm; references taken before
    the engine starts."""
    tok = tokenizer(folder)
    model, _ = load(folder, "uva")
    refs = [reference(model, tok(p)["input_ids"], NEW) for p in PROMPTS]
    assert min(r.margin for r in refs) > MIN_MARGIN
    meter = Meter(model)
    with started(model, tok, limits()) as (engine, run):
        yield engine, run, tok, meter, refs
    meter.close()


def test_a_seeded_sampled_request_draws_the_same_tokens_alone_and_beside_others(shared):
    engine, run, tok, _, refs = shared
    seeded = dict(temperature=0.8, seed=5)

    async def alone():
        return await collect(engine, request(tok, PROMPTS[0], **seeded))

    async def beside_seven():
        others = [request(tok, p, **({"temperature": 0.9} if i % 2 else {})) for i, p in enumerate(PROMPTS[1:])]
        return await asyncio.gather(collect(engine, request(tok, PROMPTS[0], **seeded)),
                                    *(collect(engine, r) for r in others))

    first = run(alone())[1].token_ids
    together = run(beside_seven())
    assert together[0][1].token_ids == first
    assert len(first) == NEW and first != refs[0].tokens   # sampled, not the argmax
    # the greedy neighbours (every other one) are still generate's tokens beside sampled requests
    for i in range(1, len(PROMPTS), 2):
        assert together[i][1].token_ids == refs[i].tokens
    other_seed = run(collect(engine, request(tok, PROMPTS[0], temperature=0.8, seed=6)))[1].token_ids
    assert other_seed != first
    assert len(engine.sampler) == 0   # every draw state discarded


def _a_stop_string(tok, tokens: list[int]) -> tuple[str, int]:
    """A word the greedy text holds past its start (and before any partial character): (stop, where)."""
    full = tok.decode(tokens, skip_special_tokens=True)
    for i in range(2, len(tokens)):
        piece = tok.decode([tokens[i]]).strip()
        head = tok.decode(tokens[: i + 1], skip_special_tokens=True)
        if piece.isascii() and piece.isalpha() and "\ufffd" not in head and full.find(piece) > 0:
            return piece, full.find(piece)
    raise AssertionError(f"no usable stop string in {full!r}")


@pytest.mark.parametrize("which", [0, 2, 5])
def test_a_stop_string_ends_the_text_before_it_with_finish_stop(shared, which):
    engine, run, tok, _, refs = shared
    full = tok.decode(refs[which].tokens, skip_special_tokens=True)
    stop, at = _a_stop_string(tok, refs[which].tokens)
    text, last, _ = run(collect(engine, request(tok, PROMPTS[which], stop=["\x00never", stop])))
    assert (text, last.finish) == (full[:at], "stop"), (full, stop)
    assert stop not in text and last.completion_tokens < NEW
    assert last.token_ids == refs[which].tokens[: last.completion_tokens]
    assert engine.running == 0
    # the stopped sequence is cancelled in the manager, which delivers it no finished output: its handler is gone
    assert not engine.manager.output_router.result_handlers


def test_a_stop_string_that_never_appears_changes_nothing(shared):
    engine, run, tok, _, refs = shared
    text, last, n = run(collect(engine, request(tok, PROMPTS[1], stop="\x00never")))
    assert (text, last.finish, last.token_ids) == (tok.decode(refs[1].tokens, skip_special_tokens=True), "length",
                                                   refs[1].tokens)
    assert n > 1   # streamed in pieces


def test_cancelling_a_consumer_mid_stream_frees_its_slot(shared):
    engine, run, tok, meter, refs = shared
    long = CONTEXT - len(tok(PROMPTS[3])["input_ids"])

    async def cancel_then_follow():
        events = engine.generate(request(tok, PROMPTS[3], max_tokens=long))
        n = 0
        async for _ in events:
            n += 1
            if n == 2:
                break
        assert engine.running == 1   # the generator still holds its slot until it is closed
        await events.aclose()
        assert engine.running == 0
        at_cancel = meter.decode_steps
        await asyncio.sleep(0.3)
        after = meter.decode_steps - at_cancel
        return after, await collect(engine, request(tok, PROMPTS[4]))

    after, (_, last, _) = run(cancel_then_follow())
    assert after < long // 2, f"{after} decode steps after the cancel: the sequence went on"
    assert last.token_ids == refs[4].tokens and engine.running == 0
    assert not engine.manager.output_router.result_handlers


def test_a_consumer_that_breaks_and_drops_the_stream_frees_its_slot(shared):
    engine, run, tok, _, refs = shared

    async def drop():
        async for _ in engine.generate(request(tok, PROMPTS[0], max_tokens=100)):
            break
        deadline = time.monotonic() + 5
        while engine.running and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return engine.running, await collect(engine, request(tok, PROMPTS[5]))

    running, (_, last, _) = run(drop())
    assert running == 0 and last.token_ids == refs[5].tokens


# --- admission --------------------------------------------------------------------------------------------

def test_a_request_past_the_slots_and_the_queue_is_refused_at_once(folder):
    tok = tokenizer(folder)
    model, _ = load(folder, "uva")
    with started(model, tok, limits(concurrency=1, queue=1)) as (engine, run):
        async def three():
            first = engine.generate(request(tok, PROMPTS[0], max_tokens=20))
            got = [await first.__anext__()]           # the first request holds the only slot
            assert engine.running == 1
            second = asyncio.create_task(collect(engine, request(tok, PROMPTS[1])))
            deadline = time.monotonic() + 5
            while engine.waiting < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.001)
            assert (engine.running, engine.waiting) == (1, 1)
            t0 = time.perf_counter()
            with pytest.raises(QueueFull) as info:
                await engine.generate(request(tok, PROMPTS[2])).__anext__()
            refused_in = time.perf_counter() - t0
            got += [ev async for ev in first]
            return got, await second, refused_in, str(info.value)

        got, (_, second, _), refused_in, why = run(three())
        assert refused_in < 0.5
        assert "--max-concurrency 1" in why and "--max-queue 1" in why and "retry later" in why
        assert (got[-1].finish, got[-1].completion_tokens) == ("length", 20)
        assert (second.finish, second.completion_tokens) == ("length", NEW)
        assert (engine.running, engine.waiting) == (0, 0)
        # the slot is free again
        _, last, _ = run(collect(engine, request(tok, PROMPTS[2])))
        assert last.finish == "length"
