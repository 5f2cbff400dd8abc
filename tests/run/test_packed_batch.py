"""The runtime under transformers' continuous batching (the server's decoding, serve/engine.py): its sequences
packed into one [1, T] row, `max_length_q` the longest query of the call.

What is checked: the runtime reads `max_length_q` as the call's new tokens per sequence, so a call where every
sequence adds one token counts as a decode step (and the device cache serves it, as it serves generate's decode
steps), a prefill call does not; the tokens of four packed sequences equal generate's one by one; a plain forward
without the keyword keeps its own count.
"""

from __future__ import annotations

import pytest
import torch

from fixtures_models import SIZES, load
from moe_offload.tiny.make import make_tiny

NEW = 6


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("packed") / "qwen3_moe", family="qwen3_moe", **SIZES)


def _batch(model, prompts: list[list[int]]):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    gen = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=16, max_batch_tokens=64, max_requests_per_batch=4,
                                  allow_block_sharing=False, use_cuda_graph=False)
    out = model.generate_batch(inputs=prompts, generation_config=gen, continuous_batching_config=cb,
                               progress_bar=False)
    return [out[k].generated_tokens for k in sorted(out, key=lambda k: int(k.split("_")[1]))]


def test_packed_decode_steps_are_decode_steps(folder):
    model, _ = load(folder, offload_gb=0.0001, cache_gb=0.00005)
    rt = model.moe_offload_runtime
    prompts = [[1, 5, 9, 13, 17, 21][: 3 + i] for i in range(4)]
    refs = [model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=[])[0, len(p):].tolist()
            for p in prompts]
    rt.counter.reset()
    rt.cache.reset()
    got = _batch(model, prompts)
    assert got == refs
    calls = list(zip(rt.counter.calls, rt.counter.decode))
    assert calls[0] == ((6, calls[0][0][1]), False)          # the packed prefill: the longest prompt, 6 tokens
    decodes = [(n, b) for (n, b), dec in calls if dec]
    assert len(decodes) == NEW - 1 and all(n == 1 for n, _ in decodes)   # one token per sequence per step
    assert rt.cache.policy.hits + rt.cache.policy.misses > 0             # the cache served the packed steps


def test_plain_forward_keeps_its_token_count(folder):
    model, _ = load(folder, offload_gb=0.0001)
    rt = model.moe_offload_runtime
    rt.counter.reset()
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]))
    assert rt.counter.calls[-1][0] == 3 and rt.counter.decode == [False]
