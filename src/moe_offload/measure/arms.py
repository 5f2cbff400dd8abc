"""What a bench compares, as the user names it: the arms, the concurrency levels, the prompts file.

An *arm* is one way of choosing what to offload: `resident` (nothing), `declaration` (module declaration
order, today's engines), `sparse-first` (by access density), `frequency` (expert by expert, from routing
statistics), `explicit:SEG[+SEG...]` (only tensors under those name segments), `accelerate` (the peer,
transformers + accelerate at the same budget), or `plan`: a saved plan (`--plan PLAN.json`), applied as it
is, with `resident` the only arm beside it (every other arm places the model its own way at a budget, and a
bench of a saved plan has no budget of its own).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..errors import MoeOffloadError

NAMED_ARMS = ("resident", "declaration", "sparse-first", "frequency", "accelerate")
PLAN_ARM = "plan"
DEFAULT_ARMS = "resident,declaration,sparse-first"
DEFAULT_CONCURRENCY = "1,4"


@dataclass(frozen=True)
class Arm:
    name: str                        # as given: resident, declaration, sparse-first, explicit:a+b, accelerate, plan
    policy: str | None               # None: resident (offload nothing); "accelerate": transformers + accelerate;
                                     # "plan": the saved plan
    offload_params: tuple[str, ...] = ()

    def load_kwargs(self, budget: dict, stats=None, plan=None) -> dict:
        """`stats`: the routing statistics the frequency arm places by (the other arms take none); `plan`:
        the saved plan the plan arm applies (it takes no budget)."""
        if self.policy is None:
            return dict(offload_gb=0.0)
        if self.policy == PLAN_ARM:
            return dict(plan=plan)
        if self.policy == "accelerate":   # the bench's own plan at this budget: accelerate_arm maps it
            return dict(budget)
        kw = dict(budget, policy=self.policy)
        if self.policy == "frequency":
            kw["stats"] = stats
        if self.offload_params:
            kw["offload_params"] = list(self.offload_params)
        return kw


def parse_arms(spec: str | Sequence[str]) -> list[Arm]:
    """`resident,declaration,sparse-first,explicit:experts+shared_expert` -> arms, validated."""
    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec)]
    arms: list[Arm] = []
    for item in items:
        if item in NAMED_ARMS or item == PLAN_ARM:
            arms.append(Arm(item, None if item == "resident" else item))
        elif item.startswith("explicit:"):
            segs = tuple(s.strip() for s in item[len("explicit:"):].split("+"))
            if not all(segs) or any(" " in s or s.strip(".") != s for s in segs):
                raise MoeOffloadError(f"arm {item!r} is malformed: write explicit:SEG or explicit:SEG+SEG, "
                                      "each SEG a dotted name segment sequence such as experts or mlp.experts")
            arms.append(Arm(item, "sparse-first", segs))
        else:
            raise MoeOffloadError(f"unknown arm {item!r}: use resident, declaration, sparse-first, frequency, "
                                  "accelerate or explicit:SEG[+SEG...], comma-separated (and plan, with --plan "
                                  "PLAN.json)")
    names = [a.name for a in arms]
    if not arms or len(set(names)) != len(names):
        raise MoeOffloadError(f"--arms {','.join(names)!r}: give each arm once, at least one")
    return arms


def arms_of_plan(arms: Sequence[Arm] | None, has_plan: bool) -> list[Arm]:
    """The arms checked against whether a saved plan is benched: with one, the plan arm (added when --arms
    does not name it) and at most `resident` beside it; without one, no plan arm. `arms` None: the default
    (the plan alone with a plan, DEFAULT_ARMS without)."""
    if not has_plan:
        arms = parse_arms(DEFAULT_ARMS) if arms is None else list(arms)
        if any(a.policy == PLAN_ARM for a in arms):
            raise MoeOffloadError("the plan arm applies a saved plan: give --plan PLAN.json (save one with "
                                  "`moe-offload plan MODEL --save PLAN.json`), or drop plan from --arms")
        return arms
    arms = [] if arms is None else list(arms)
    placing = [a.name for a in arms if a.policy not in (None, PLAN_ARM)]
    if placing:
        raise MoeOffloadError(f"--plan and the arm{'s' if len(placing) > 1 else ''} {', '.join(placing)} both "
                              "decide the placement: a bench of a saved plan measures the plan (arm plan), with "
                              "resident beside it at most; give --arms resident or no --arms, or bench those arms "
                              "without --plan")
    if not any(a.policy == PLAN_ARM for a in arms):
        arms.append(Arm(PLAN_ARM, PLAN_ARM))
    return arms


def parse_concurrency(spec: str | Sequence[int]) -> list[int]:
    """`1,4` -> [1, 4]: distinct positive integers."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    try:
        levels = [int(str(x).strip()) for x in items]
    except ValueError:
        raise MoeOffloadError(f"--concurrency {spec!r} is not a list of integers: write e.g. 1,4") from None
    if not levels or min(levels) < 1 or len(set(levels)) != len(levels):
        raise MoeOffloadError(f"--concurrency {spec!r}: give distinct sequence counts of at least 1, e.g. 1,4")
    return levels


def read_prompts(path: str | os.PathLike) -> list[str]:
    """One prompt per non-empty line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise MoeOffloadError(f"cannot read prompts from {path} ({type(exc).__name__}); give a UTF-8 text file "
                              "with one prompt per line") from exc
    return [line.strip() for line in lines if line.strip()]
