"""Memory-leak detection from RSS samples: a robust slope, so one spike is not a leak.

The slope is Theil-Sen (the median of all pairwise slopes): a single 100 MB spike moves a
least-squares fit a lot but leaves the median untouched. A leak must also be a *trend*: the
Kendall tau of the samples (share of concordant minus discordant pairs) must be high, which
rejects noisy processes whose median slope happens to be positive.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np


def theil_sen(t: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Return (slope, kendall_tau) of y over t. Needs at least 3 points with distinct t."""
    i, j = np.triu_indices(len(t), k=1)
    dt = t[j] - t[i]
    dy = y[j] - y[i]
    ok = dt > 0
    if ok.sum() < 3:
        return 0.0, 0.0
    slope = float(np.median(dy[ok] / dt[ok]))
    tau = float(np.sign(dy[ok]).sum() / ok.sum())
    return slope, tau


@dataclass
class GrowthEstimate:
    rate: float  # bytes per second (Theil-Sen)
    tau: float  # Kendall tau in [-1, 1]
    span_s: float  # time covered by the samples used
    n: int


class Window:
    """Samples of the last `span_s` seconds, thinned to at most `max_samples` (every other one dropped)."""

    def __init__(self, span_s: float, max_samples: int = 240):
        self.span_s = span_s
        self.max_samples = max_samples
        self.samples: deque[tuple[float, float]] = deque()
        self._min_gap = span_s / max_samples  # samples closer than this are merged into the newest

    def add(self, t: float, value: float):
        # Bounded resolution: while the newest sample is younger than the gap, it is replaced
        # (it always holds the latest reading); otherwise a new one is appended.
        if len(self.samples) > 1 and t - self.samples[-2][0] < self._min_gap:
            self.samples[-1] = (t, value)
        else:
            self.samples.append((t, value))
        self._trim(t)

    def _trim(self, now: float):
        while self.samples and now - self.samples[0][0] > self.span_s:
            self.samples.popleft()

    def clear(self):
        self.samples.clear()

    def estimate(self) -> GrowthEstimate | None:
        if len(self.samples) < 3:
            return None
        arr = np.asarray(self.samples, dtype=np.float64)
        t, y = arr[:, 0] - arr[0, 0], arr[:, 1]
        rate, tau = theil_sen(t, y)
        return GrowthEstimate(rate=rate, tau=tau, span_s=float(t[-1]), n=len(t))


@dataclass
class LeakVerdict:
    rule: str  # "rss_growth_short" or "rss_growth_long"
    rate: float  # bytes/s
    limit: float
    tau: float
    span_s: float


class LeakDetector:
    """Two windows (short: the MB/min rule, long: the MB/h rule) over the RSS of one process tree."""

    def __init__(self, short_window_s: float, long_window_s: float, short_limit: float, long_limit: float,
                 min_window_fraction: float = 0.5, trend_min: float = 0.6, max_samples: int = 240):
        self.rules = {
            "rss_growth_short": (Window(short_window_s, max_samples), short_limit),
            "rss_growth_long": (Window(long_window_s, max_samples), long_limit),
        }
        self.min_window_fraction = min_window_fraction
        self.trend_min = trend_min

    def add(self, t: float, rss: float):
        for window, _ in self.rules.values():
            window.add(t, rss)

    def reset(self):
        """After a restart the old samples say nothing about the new process."""
        for window, _ in self.rules.values():
            window.clear()

    def rates(self) -> dict[str, GrowthEstimate | None]:
        return {name: window.estimate() for name, (window, _) in self.rules.items()}

    def check(self) -> LeakVerdict | None:
        for name, (window, limit) in self.rules.items():
            est = window.estimate()
            if est is None or est.span_s < self.min_window_fraction * window.span_s:
                continue
            if est.rate > limit and est.tau >= self.trend_min:
                return LeakVerdict(rule=name, rate=est.rate, limit=limit, tau=est.tau, span_s=est.span_s)
        return None
