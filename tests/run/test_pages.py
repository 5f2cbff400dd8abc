"""The page arena the device cache and the host cache share (run/pages.py, `PagedArena`).

Rows as a Qwen3 layer has them: gate_up_proj's row two pages, down_proj's one (page_bytes their gcd). What is
checked: after evictions in any order a claimed row is one run of consecutive page ids wherever the free pages
hold one (a row in one run is read in place, host_cache.run_start), the shortest run that fits taken first; the
arena still fits whatever mix the capacity admits (scattered pages where no run is long enough); pages are never
handed out twice, and every page comes back.
"""

from __future__ import annotations

import random

from moe_offload.run.host_cache import HostCache
from moe_offload.run.pages import PagedArena
from moe_offload.storage.host import expert_runs

PAGE = 4096
ROWS = (2 * PAGE, PAGE)            # one expert: gate_up_proj, down_proj


def arena(experts: int) -> PagedArena:
    a = PagedArena()
    a.carve(ROWS, [sum(ROWS)] * 64, experts * sum(ROWS))
    return a


def is_run(pages: list[int]) -> bool:
    return HostCache.run_start(pages) is not None


def longest_free_run(free: list[int]) -> int:
    return max((count for _, _, count in expert_runs(free)), default=0)


def test_a_row_claimed_after_evictions_is_one_run_of_pages():
    a = arena(4)
    for e in range(4):
        a.claim(e, ROWS)
    a.release(1)                   # its gate_up row [3, 4] and down row [5]: freed, the next expert reuses them
    pages = a.claim(9, ROWS)
    assert [is_run(p) for p in pages] == [True, True], pages
    a.release(0)
    a.release(2)                   # [0, 1, 2] and [6, 7, 8]: two runs of three
    for key in (10, 11):
        assert all(is_run(p) for p in a.claim(key, ROWS))
    assert not a.free


def test_the_shortest_run_that_fits_is_taken_and_longer_runs_stay_whole():
    a = arena(4)
    for e in range(4):
        a.claim(e, ROWS)
    a.release(2)                   # pages 6-8: a run of three
    a.release(0)                   # pages 0-2: a run of three
    a.claim("down", (0, PAGE))     # one page: from the lowest run of three, leaving a run of two
    assert a.held["down"] == ([], [0])
    assert a.claim("gate_up", (2 * PAGE, 0)) == ([1, 2], [])     # the run of two fits exactly: 6-8 stays whole
    assert a.free == [6, 7, 8]


def test_without_a_long_enough_run_a_row_takes_scattered_pages_and_the_arena_still_fits_the_capacity():
    a = PagedArena()
    a.carve([PAGE, 2 * PAGE], [PAGE] * 6, 6 * PAGE)
    for e in range(6):
        a.claim(e, (PAGE, 0))
    for e in (0, 2, 4):            # free pages 0, 2, 4: no two consecutive
        a.release(e)
    pages = a.claim("wide", (0, 2 * PAGE))[1]
    assert pages == [0, 2] and a.free == [4]


def test_random_admissions_and_evictions_never_share_a_page_and_take_a_run_wherever_one_fits():
    rng = random.Random(0)
    a = PagedArena()
    a.carve([PAGE, 2 * PAGE, 3 * PAGE], [6 * PAGE] * 64, 40 * PAGE)
    total, held, runs = len(a.free), [], 0
    for key in range(3000):
        rows = (rng.choice((PAGE, 2 * PAGE, 3 * PAGE)),)
        while len(a.free) < rows[0] // PAGE or (held and rng.random() < 0.4):
            a.release(held.pop(rng.randrange(len(held))))
        fits = longest_free_run(a.free) >= rows[0] // PAGE
        (got,) = a.claim(key, rows)
        held.append(key)
        assert len(got) == rows[0] // PAGE and (is_run(got) or not fits), (got, a.free)
        runs += fits
        owned = [p for k in held for row in a.held[k] for p in row]
        assert len(owned) == len(set(owned)) and sorted(owned + a.free) == list(range(total))
    assert 0 < runs < 3000          # both cases met: a run that fits, and none
    for k in held:
        a.release(k)
    assert a.free == list(range(total))
