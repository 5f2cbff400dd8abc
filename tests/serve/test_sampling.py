"""serve's per-request sampler on its own: draws on the logits' device with no read back (meta logits, which
cannot be read, go through), the distribution it draws from (softmax at the temperature, top-p's set), seeded
draws independent of the batch around them, and greedy rows left as they are."""

from __future__ import annotations

import pytest
import torch

from moe_offload.serve.sampling import Sampler, draw_tokens, uniforms


class Request:
    def __init__(self, rid: str):
        self.state = type("State", (), {"request_id": rid})()


def step(sampler: Sampler, rids: list[str], scores: torch.Tensor) -> torch.Tensor:
    return sampler(scores, sampler.prepare_tensor_args([Request(r) for r in rids]))


def test_the_sampled_rows_are_drawn_on_the_logits_device_without_reading_it_back():
    # meta tensors hold no data: any read back to the host (.tolist(), int(), a CPU generator's multinomial)
    # raises; the draw is tensor ops on the logits' own device from end to end
    s = Sampler()
    s.add("a", 0.8, 1.0, 5)
    s.add("b", 1.0, 0.5, None)
    out = step(s, ["greedy", "a", "b"], torch.randn(3, 50, device="meta"))
    assert out.device.type == "meta" and out.shape == (3, 50)


def test_sampled_rows_become_one_hot_on_their_draw_and_greedy_rows_are_untouched():
    s = Sampler()
    s.add("a", 1.0, 1.0, 11)
    scores = torch.randn(3, 40)
    out = step(s, ["x", "a", "y"], scores.clone())
    assert torch.equal(out[0], scores[0]) and torch.equal(out[2], scores[2])
    assert (out[1] == 0).sum() == 1 and torch.isinf(out[1]).sum() == 39
    assert s._draws["a"].step == 1   # the next step draws fresh noise


def test_a_seed_draws_the_same_tokens_whatever_rows_and_positions_surround_it():
    def run(rids, seed_row):
        s = Sampler()
        for r in rids:
            if r != "greedy":
                s.add(r, 0.9, 0.95, 42 if r == "seeded" else hash(r) % 1000)
        g, others = torch.Generator().manual_seed(0), torch.Generator().manual_seed(len(rids))
        tokens = []
        for _ in range(12):
            logits = torch.randn(1, 300, generator=g)
            batch = torch.randn(len(rids), 300, generator=others)
            batch[seed_row] = logits[0]
            tokens.append(int(step(s, rids, batch)[seed_row].argmax()))
        return tokens

    alone = run(["seeded"], 0)
    assert run(["greedy", "other", "seeded", "more"], 2) == alone
    assert len(set(alone)) > 3   # drawn, not one token each step


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_the_draws_follow_softmax_at_the_temperature(temperature):
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, 0.5]])
    n = 40000
    toks = draw_tokens(logits.expand(n, 5), [temperature] * n, [1.0] * n, [3] * n, list(range(n)))
    freq = torch.bincount(toks, minlength=5).double() / n
    want = torch.softmax(logits[0].double() / temperature, -1)
    assert (freq - want).abs().max() < 0.01   # 40000 draws: one standard error is under 0.0025


def test_top_p_draws_only_from_the_smallest_set_reaching_p():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, 0.5]])   # probabilities 0.09 0.23 0.63 0.03 0.14
    n = 20000
    toks = draw_tokens(logits.expand(n, 5), [1.0] * n, [0.7] * n, list(range(n)), [0] * n)
    freq = torch.bincount(toks, minlength=5).double() / n
    assert set(torch.nonzero(freq).flatten().tolist()) == {1, 2}   # 0.63 < 0.7 <= 0.63 + 0.23
    assert abs(freq[2] - 0.63 / (0.63 + 0.23)) < 0.015
    tiny = draw_tokens(logits.expand(50, 5), [1.0] * 50, [1e-6] * 50, list(range(50)), [0] * 50)
    assert tiny.eq(2).all()   # at least one token: the most likely


def test_the_noise_is_uniform_and_keyed_by_seed_and_step():
    u = uniforms([1, 2, 2**63 + 5], [0, 0, 7], 20000, "cpu")
    assert u.dtype == torch.float32 and 0 < u.min() and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.01 and abs(u.std() - 12 ** -0.5) < 0.01
    assert not torch.equal(u[0], u[1])
    assert torch.equal(uniforms([2], [0], 20000, "cpu")[0], u[1])
    assert not torch.equal(uniforms([2], [1], 20000, "cpu")[0], u[1])
