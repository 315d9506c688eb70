"""Leak detection: the robust slope, and real processes that leak (restarted) or merely churn."""

import subprocess

import numpy as np
import pytest
from helpers import LEAKER, MB, NOISY, py, wait_for

from openglm.agent.resilience import Action, LeakDetector, MonitorConfig, ResourceMonitor, Threshold, theil_sen
from openglm.agent.resilience.process_tree import Supervised


def test_theil_sen_matches_least_squares_on_clean_data_and_ignores_a_spike():
    rng = np.random.default_rng(0)
    t = np.linspace(0, 60, 61)
    y = 5.0 * t + rng.normal(0, 1, t.size)
    slope, tau = theil_sen(t, y)
    ls_slope = np.polyfit(t, y, 1)[0]
    assert slope == pytest.approx(ls_slope, rel=0.02)
    assert tau > 0.9
    spiky = y.copy()
    spiky[-3:] += 2000.0  # a transient spike at the end of the window
    spiked_ls = np.polyfit(t, spiky, 1)[0]
    spiked_ts, _ = theil_sen(t, spiky)
    assert abs(spiked_ls - 5.0) > 5 * abs(spiked_ts - 5.0)


def test_detector_needs_a_filled_window_and_a_trend():
    det = LeakDetector(short_window_s=10, long_window_s=100, short_limit=1.0, long_limit=0.5)
    for i in range(4):  # steep but only 3 s of a 10 s window: too early to judge
        det.add(float(i), 100.0 * i)
    assert det.check() is None
    for i in range(4, 11):
        det.add(float(i), 100.0 * i)
    verdict = det.check()
    assert verdict is not None and verdict.rule == "rss_growth_short" and verdict.rate == pytest.approx(100.0)
    flat = LeakDetector(short_window_s=10, long_window_s=100, short_limit=1.0, long_limit=0.5)
    rng = np.random.default_rng(1)
    for i in range(40):  # big noise, no drift
        flat.add(i * 0.5, 1000.0 + rng.uniform(0, 500))
    assert flat.check() is None


def test_long_window_rule_catches_a_slow_leak_the_short_rule_misses():
    det = LeakDetector(short_window_s=60, long_window_s=3600, short_limit=10 * MB / 60, long_limit=2 * MB / 3600)
    for i in range(0, 3601, 30):  # 3 MB/h: far below 10 MB/min, above 2 MB/h
        det.add(float(i), 500 * MB + 3 * MB * i / 3600)
    verdict = det.check()
    assert verdict is not None and verdict.rule == "rss_growth_long"
    assert verdict.rate * 3600 / MB == pytest.approx(3.0, rel=0.05)


def _fast_config(**kw) -> MonitorConfig:
    # Time compressed 60x: 10 MB/min becomes 10 MB/s, a 5-minute window becomes 2 s.
    th = {"rss_growth_short": Threshold(10 * MB, Action.RESTART_TREE, cooldown_s=1.0)}
    return MonitorConfig(interval_s=0.05, short_window_s=2.0, long_window_s=60.0, thresholds=th, **kw)


def test_real_leaking_child_is_detected_restarted_and_the_task_continues(tmp_path):
    progress = tmp_path / "progress"
    child = Supervised(py(LEAKER, 30, progress, 40))  # 30 MB/s ("30 MB/min" at 60x)
    child.start()
    events = []
    mon = ResourceMonitor(_fast_config(), roots=child.pids, workspace=str(tmp_path),
                          on_event=lambda k, d: events.append((k, d)),
                          handlers={Action.RESTART_TREE: child.restart})
    first_pid = child.pid
    try:
        with mon:
            assert wait_for(lambda: child.restarts >= 1, 10.0), f"no restart; readings {mon.status()}"
            assert child.pid != first_pid
            assert wait_for(lambda: progress.exists() and "39" in progress.read_text().split(), 20.0)
    finally:
        child.stop()
    steps = [int(x) for x in progress.read_text().split()]
    assert sorted(set(steps)) == list(range(40))  # no step lost across the restart(s)
    actions = [d for k, d in events if k == "monitor_action"]
    assert actions and actions[0]["metric"] == "rss_growth_short" and actions[0]["value"] > 10 * MB
    assert actions[0]["outcome"].startswith("restarted")


def test_steady_noisy_child_is_not_a_leak(tmp_path):
    proc = subprocess.Popen(py(NOISY, 40))
    restarts = []
    mon = ResourceMonitor(_fast_config(), roots=[proc.pid], workspace=str(tmp_path),
                          handlers={Action.RESTART_TREE: restarts.append})
    try:
        for _ in range(80):  # 4 s of samples at 20 Hz, with the RSS swinging by up to 40 MB
            mon.sample()
            wait_for(lambda: False, 0.05)
        peak = max(mon.status()["rss_bytes"], 1)
    finally:
        proc.kill()
        proc.wait()
    assert not restarts
    assert peak > 10 * MB  # the process really was allocating
