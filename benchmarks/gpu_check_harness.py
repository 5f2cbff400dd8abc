"""The harness of benchmarks/gpu_check.py: time limits for each step and for the whole run (with a watchdog
for hangs in native code), the PASS / FAIL / SKIP rows the checks leave, and the byte units they print in."""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import time

GIB = 2 ** 30
MIB = 2 ** 20


class StepTimeout(BaseException):
    """One step ran past its limit. A BaseException: library code's `except Exception` must not swallow it."""


class RunTimeout(BaseException):
    """The whole run reached --time-limit."""


class Guard:
    """Time limits: per step (SIGALRM, soft: raised in Python) under one deadline for the run, and a
    faulthandler watchdog a little after the deadline for hangs inside native code (a stuck kernel)."""

    def __init__(self, total_s: float, grace_s: float = 30):
        self.deadline = time.monotonic() + total_s
        self.total_s = total_s
        self.step = ""
        signal.signal(signal.SIGALRM, self._fire)
        faulthandler.dump_traceback_later(total_s + grace_s, exit=True)

    def _fire(self, signum, frame):
        if time.monotonic() >= self.deadline - 0.01:
            raise RunTimeout(f"gpu_check ran past --time-limit {self.total_s:.0f} s (in step {self.step!r})")
        raise StepTimeout(f"step {self.step!r} ran past its limit")

    @contextlib.contextmanager
    def limit(self, step: str, seconds: float):
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RunTimeout(f"gpu_check ran past --time-limit {self.total_s:.0f} s (before step {step!r})")
        self.step = step
        signal.setitimer(signal.ITIMER_REAL, min(seconds, left))
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    def close(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()


class Checks:
    def __init__(self):
        self.rows: list[dict] = []

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.rows.append({"check": name, "result": "PASS" if ok else "FAIL", "detail": detail})
        print(f"{'PASS' if ok else 'FAIL'}  {name}" + (f"  ({detail})" if detail else ""), flush=True)
        return ok

    def skip(self, name: str, why: str) -> None:
        self.rows.append({"check": name, "result": "SKIP", "detail": why})
        print(f"SKIP  {name}  ({why})", flush=True)

    @property
    def failed(self) -> list[dict]:
        return [r for r in self.rows if r["result"] == "FAIL"]
