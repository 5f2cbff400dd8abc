"""The serving engine: concurrent requests decoded together by transformers' own continuous batching
(`ContinuousBatchingManager`: a paged KV cache, sequences joining and leaving the batch at any step) on the
model as moe_offload loaded it, with its offloaded tiers, caches and counters.

The runtime's experts function and hooks work under continuous batching (tested): a packed batch is one
forward over [1, T] tokens with `max_length_q` the longest query, which the runtime reads as the call's new
tokens per sequence, so a step where every sequence adds one token is a decode step (the caches serve it,
the counters count it).

Admission is ours, in front of the manager: at most `max_concurrency` sequences are in the batch, at most
`max_queue` requests wait for a slot, and a request beyond both is refused at once (`QueueFull` -> 429).
Greedy requests are the manager's argmax; sampled ones draw in `sampling.Sampler`, keyed by their own seed, on the
logits' device.
Text is detokenized incrementally; `stop` strings end a sequence (it is cancelled in the manager) and are
not returned. A request whose consumer goes away (the client disconnected) is cancelled at once: its slot
is free for the next request and the manager frees its KV blocks at its next step.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from .protocol import ApiError, TextRequest
from .sampling import Sampler, install
from ..run.decode_attention import plain_attention
from ..run.runtime import runtime_of
from ..run.transformers_compat import drop_result_handler


class QueueFull(Exception):
    pass


@dataclass(frozen=True)
class Limits:
    max_concurrency: int        # sequences decoded together
    max_queue: int              # requests waiting for a slot
    context: int                # tokens per sequence (prompt + completion)
    page_size: int              # KV cache page, tokens

    @property
    def kv_blocks(self) -> int:
        return self.max_concurrency * math.ceil(self.context / self.page_size) + 1


def kv_bytes_per_token(config, dtype_bytes: int) -> int:
    """Bytes of K and V one token keeps in every layer (the paged cache's unit)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * text.num_hidden_layers * heads * head_dim * dtype_bytes


@dataclass
class Event:
    """What a request's consumer receives: new text, and at the end the finish reason and the counts."""

    text: str
    finish: str | None = None         # "stop" | "length" at the end, else None
    completion_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)


class _Admission:
    """Slots for sequences in flight, a bounded FIFO of waiters (event-loop side only)."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.running = 0
        self.waiters: collections.deque[asyncio.Future] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self.waiters)

    async def acquire(self) -> None:
        if self.running < self.limits.max_concurrency and not self.waiters:
            self.running += 1
            return
        if len(self.waiters) >= self.limits.max_queue:
            raise QueueFull(f"{self.running} sequences are running (--max-concurrency "
                            f"{self.limits.max_concurrency}) and {len(self.waiters)} requests wait (--max-queue "
                            f"{self.limits.max_queue}); retry later")
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        try:
            await fut                       # release() hands its slot over: running stays counted
        except asyncio.CancelledError:
            if fut in self.waiters:
                self.waiters.remove(fut)
            elif fut.done() and not fut.cancelled():
                self.release()              # the slot came as the waiter left
            raise

    def release(self) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.running -= 1


class Engine:
    """One model's continuous batching, started once, stopped once."""

    def __init__(self, model, tokenizer, limits: Limits, *, metrics=None):
        from transformers import ContinuousBatchingConfig, GenerationConfig

        self.model, self.tokenizer, self.limits, self.metrics = model, tokenizer, limits, metrics
        eos = model.generation_config.eos_token_id
        self.eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        gen = GenerationConfig(do_sample=False, max_new_tokens=limits.context, eos_token_id=self.eos or -1,
                               pad_token_id=tokenizer.pad_token_id or 0)
        # Prefix sharing off: a request's KV is computed from its own tokens, whatever else runs (greedy output
        # then equals generate's whatever other requests run beside it).
        cb = ContinuousBatchingConfig(page_size=limits.page_size, num_blocks=limits.kv_blocks,
                                      max_batch_tokens=max(256, limits.max_concurrency),
                                      max_requests_per_batch=limits.max_concurrency, allow_block_sharing=False,
                                      use_cuda_graph=False, max_queue_size=0)
        plain_attention(model)   # continuous batching accepts only its own attention implementations
        self.manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        device = runtime_of(model).device
        if model.device != device:   # a disk-tier first parameter (its placeholder is meta)
            self.manager.model = _OnDevice(model, device)
        self.sampler = Sampler()
        install(self.manager, self.sampler)
        self.admission = _Admission(limits)
        self.started = False

    def start(self) -> None:
        self.manager.start()
        self.started = True

    def stop(self, timeout: float = 10.0) -> None:
        if self.started:
            self.manager.stop(block=True, timeout=timeout)
            self.started = False

    @property
    def alive(self) -> str | None:
        """None while the batch's thread runs, else why it does not."""
        status = getattr(self.manager, "background_thread_status", None)
        error = getattr(status, "fatal_error", None)
        if error is not None:
            return f"the decoding thread failed: {error}"
        return None if self.manager.is_running() else "the decoding thread is not running"

    @property
    def running(self) -> int:
        return self.admission.running

    @property
    def waiting(self) -> int:
        return self.admission.waiting

    async def generate(self, req: TextRequest) -> AsyncIterator[Event]:
        """The request's text as it is decoded; the last event carries the finish reason. Raises QueueFull (no
        slot and no room to wait) and ApiError (the decoding thread failed)."""
        if not req.greedy and not self.sampler.usable:
            raise ApiError(400, "this transformers' continuous batching has no per-request processor interface, so "
                                "this server decodes greedily only; send temperature 0", param="temperature")
        await self.admission.acquire()
        rid = uuid.uuid4().hex
        try:
            async for event in self._decode(req, rid):
                yield event
        finally:
            self.admission.release()

    async def _decode(self, req: TextRequest, rid: str) -> AsyncIterator[Event]:
        outputs: asyncio.Queue = asyncio.Queue()
        if not req.greedy:
            self.sampler.add(rid, req.temperature, req.top_p, req.seed)
        self.manager.register_result_handler(rid, outputs.put_nowait)
        started = time.perf_counter()
        added = self.manager.add_request(list(req.prompt_ids), request_id=rid, max_new_tokens=req.max_tokens,
                                         streaming=True, eos_token_id=[] if req.ignore_eos else (self.eos or -1))
        finished = False
        try:
            if added is None:
                raise ApiError(503, f"the decoding thread does not take requests ({self.alive or 'stopping'})",
                               type="server_error", code="unavailable")
            detok = _Detokenizer(self.tokenizer, req.stop)
            last = None
            while True:
                out = await outputs.get()
                now = time.perf_counter()
                if out.error is not None:
                    raise ApiError(500, f"decoding failed: {out.error}", type="server_error")
                tokens = list(out.generated_tokens)
                new = len(tokens) - len(detok.ids)
                if new > 0 and self.metrics is not None:
                    if last is None:
                        self.metrics.first_token(now - started)
                    else:
                        self.metrics.next_tokens(now - last, new)
                    last = now
                text, stopped = detok.feed(tokens)
                done = out.is_finished() or stopped
                if done:
                    finished = True
                    if stopped:
                        self.manager.cancel_request(rid)
                    finish = "stop" if stopped or (len(detok.ids) < req.max_tokens and not req.ignore_eos) else "length"
                    yield Event(text + detok.flush(), finish, len(detok.ids), detok.ids)
                    return
                if text:
                    yield Event(text)
        finally:
            self.sampler.discard(rid)
            if not finished:   # the consumer went away (disconnect) or an error: the sequence ends now
                self.manager.cancel_request(rid)
            # A cancelled sequence (a stop string, a disconnect) gets no finished output, which is what would
            # drop its handler: drop it here, or it stays (and takes the outputs of the steps before the cancel).
            drop_result_handler(self.manager, rid)


class _OnDevice:
    """The model as the manager sees it, on the runtime's device. transformers takes a model's device from its
    first parameter, and a disk-tier tensor's placeholder is on the meta device (its bytes stay in the
    checkpoint); every other attribute and the call are the model's own."""

    def __init__(self, model, device):
        self.__dict__["_model"], self.__dict__["device"] = model, device

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __setattr__(self, name, value):
        setattr(self._model, name, value)

    def __call__(self, *args, **kwargs):
        return self._model(*args, **kwargs)


class _Detokenizer:
    """Generated ids -> new text, holding back what could still become part of a stop string (or an incomplete
    character); `feed` says whether a stop string appeared (the text then ends before it)."""

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.sent = 0                          # characters of the text already returned
        self.text = ""
        self.hold = max((len(s) for s in stops), default=1) - 1

    def feed(self, ids: list[int]) -> tuple[str, bool]:
        self.ids = ids
        self.text = self.tokenizer.decode(ids, skip_special_tokens=True)
        for stop in self.stops:
            at = self.text.find(stop, max(self.sent - len(stop), 0))
            if at >= 0:
                self.text = self.text[:at]
                return self._take(len(self.text)), True
        end = len(self.text) - self.hold
        if self.text.endswith("\ufffd"):       # a character still incomplete
            end = min(end, len(self.text) - 1)
        return self._take(end), False

    def _take(self, end: int) -> str:
        if end <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent:end], end
        return piece

    def flush(self) -> str:
        return self._take(len(self.text))
