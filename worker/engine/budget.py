"""Time: the deadline of an invocation and the predicted duration of each kind of item."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# What an item of a kind no task gives a prior for (Task.prior_ms) costs before anything was
# observed, in ms.
OTHER_PRIOR_MS = 50.0
# What a typical item of an unknown mix costs, before anything was observed (the slowest of the
# common kinds; office documents are rarer and learnt once seen).
TYPICAL_PRIOR_MS = 400.0


# What the end of an invocation gets after its deadline, out of its buffer (the answer comes by
# the deadline + 300 ms: docs/reliability.md, 10): items record their outcome by the deadline +
# RECORD_MS, the unstarted ones are released by + RELEASE_MS and the run is finished by +
# FINISH_MS, each call bounded so that one that stalls leaves the next its time. Each is a few
# ms when nothing stalls. A call that starts late (a render killed at the deadline can take
# 100-200 ms to die on a loaded machine) still gets END_CALL_MIN_MS: a count recorded a little
# late beats one lost.
RECORD_MS = 120.0
RELEASE_MS = 180.0
FINISH_MS = 260.0
END_CALL_MIN_MS = 40.0


class Budget:
    """The deadline of one invocation: start + budget - buffer, on a monotonic clock."""

    def __init__(
        self,
        budget_ms: int,
        buffer_ms: int,
        clock: Callable[[], float] = time.monotonic,
        started: float | None = None,
    ) -> None:
        """`started`: the clock's reading when the invocation began (default: now)."""
        self.clock = clock
        self.started = clock() if started is None else started
        self.budget_ms = budget_ms
        self.work_ms = budget_ms - buffer_ms
        self.deadline = self.started + self.work_ms / 1000

    def elapsed_ms(self) -> float:
        return (self.clock() - self.started) * 1000

    def remaining_ms(self, after_ms: float = 0.0) -> float:
        """Time left until the deadline, or until `after_ms` past it (at most to the budget's
        end: the reserve comes out of the buffer)."""
        after_s = min(after_ms, self.budget_ms - self.work_ms) / 1000
        return max(0.0, (self.deadline + after_s - self.clock()) * 1000)

    def end_call_ms(self, after_ms: float) -> float:
        """The timeout of a call that records the run's outcome: until `after_ms` past the
        deadline (RECORD_MS, RELEASE_MS, FINISH_MS), and never less than END_CALL_MIN_MS."""
        return max(END_CALL_MIN_MS, self.remaining_ms(after_ms))

    def expired(self) -> bool:
        return self.clock() >= self.deadline

    def fits(self, predicted_ms: float) -> bool:
        """Whether an item predicted to take `predicted_ms` can finish before the deadline."""
        return predicted_ms <= self.remaining_ms()


def size_class(size: int | None) -> int:
    """Sizes in powers of two (0 when unknown): 1 MiB and 1.5 MiB share a class."""
    if not size or size <= 0:
        return 0
    return int(math.log2(size))


@dataclass
class _Stat:
    mean_ms: float
    max_ms: float
    samples: int


@dataclass
class Predictor:
    """Predicts an item's duration from what earlier runs (render_stats) and this run saw."""

    known: dict[tuple[str, int], _Stat] = field(default_factory=dict)
    seen: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    # What each kind costs before anything was observed (the registered tasks': Registry.priors).
    priors: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def from_rows(
        cls, rows: Iterable[Mapping[str, Any]], priors: Mapping[str, float] | None = None
    ) -> Predictor:
        known = {
            (str(r["kind"]), int(r["size_class"])): _Stat(
                float(r["ewma_ms"]), float(r["max_ms"]), int(r["samples"])
            )
            for r in rows
        }
        return cls(known=known, priors=dict(priors or {}))

    def expected_ms(self, kind: str, size_cls: int) -> float:
        """The typical duration: this run's own mean where it has one, else history, else a
        neighbouring size class scaled by size, else the prior."""
        own = self.seen.get((kind, size_cls))
        if own:
            return sum(own) / len(own)
        stat = self.known.get((kind, size_cls))
        if stat:
            return stat.mean_ms
        near = [(abs(c - size_cls), c, s) for (k, c), s in self.known.items() if k == kind]
        if near and size_cls:
            _, c, s = min(near)
            # Work grows with bytes, but less than linearly (decoding at reduced scale).
            return s.mean_ms * 1.5 ** (size_cls - c) if size_cls > c else s.mean_ms
        return self.priors.get(kind, OTHER_PRIOR_MS)

    def typical_ms(self) -> float:
        """A typical item when nothing is claimed yet: this run's mean, else history's, else
        the slowest prior (claiming too few costs one more claim; too many only a release)."""
        own = [ms for v in self.seen.values() for ms in v]
        if own:
            return sum(own) / len(own)
        if self.known:
            total = sum(s.samples for s in self.known.values())
            return sum(s.mean_ms * s.samples for s in self.known.values()) / max(total, 1)
        return TYPICAL_PRIOR_MS

    def start_ms(self, kind: str, size_cls: int) -> float:
        """A cautious estimate used to decide whether an item may start at all."""
        return self.expected_ms(kind, size_cls) * 1.25 + 20

    def observe(self, kind: str, size_cls: int, ms: float) -> None:
        self.seen.setdefault((kind, size_cls), []).append(ms)

    def summary(self) -> list[dict[str, Any]]:
        """This run's observations, to merge into render_stats."""
        return [
            {
                "kind": k,
                "size_class": c,
                "samples": len(v),
                "mean_ms": sum(v) / len(v),
                "max_ms": max(v),
            }
            for (k, c), v in sorted(self.seen.items())
        ]
