"""util/threads.py: how many threads to run when other processes take cores, and the wait policy."""

import os

import pytest

from openglm.util import threads
from openglm.util.threads import ThreadGovernor, choose, read_proc_stat


@pytest.mark.parametrize("others,current,expected", [
    (0.0, 2, 2),  # quiet: every core
    (0.3, 2, 2),  # others use under half a core: it still counts as free
    (0.6, 2, 1),  # one core taken
    (1.0, 2, 1),
    (2.0, 2, 1),  # both taken: still one thread
    (0.3, 1, 1),  # back up only once others are well below half a core (no flapping at the threshold)
    (0.1, 1, 2),
])
def test_choose_gives_work_the_cores_others_leave_free(others, current, expected):
    assert choose(limit=2, cores=2, others=others, current=current) == expected


def test_choose_never_exceeds_the_limit_or_the_cores():
    assert choose(limit=4, cores=2, others=0.0, current=4) == 2
    assert choose(limit=1, cores=16, others=0.0, current=1) == 1
    assert choose(limit=8, cores=16, others=10.2, current=8) == 6


class Machine:
    """A fake /proc/stat and process clock: `busy` cores' worth of others' work plus ours, per second."""

    def __init__(self):
        self.t, self.busy_total, self.mine, self.others, self.ours = 0.0, 0.0, 0.0, 0.0, 2.0

    def advance(self, dt):
        self.t += dt
        self.mine += self.ours * dt
        self.busy_total += (self.ours + self.others) * dt


def _governor(m: Machine, applied: list) -> ThreadGovernor:
    return ThreadGovernor(limit=2, interval=1.0, cores=2, apply=applied.append, clock=lambda: m.t,
                          own_cpu=lambda: m.mine, machine=lambda: (m.busy_total, 2 * m.t))


def test_governor_drops_a_thread_when_a_competitor_appears_and_returns_it_after():
    m, applied = Machine(), []
    gov = _governor(m, applied)
    assert gov.poll() is None and gov.current == 2  # the first sample only sets the baseline
    m.advance(1.0)
    assert gov.poll() is None and gov.others == pytest.approx(0.0)  # quiet: our own 2 cores' worth is ours
    m.others, m.ours = 1.0, 1.0  # a busy process takes a core; our spinning no longer counts against it
    m.advance(0.5)
    assert gov.poll() is None  # within the interval: no new sample
    m.advance(0.5)
    assert gov.poll() == 1 and applied == [1] and gov.others == pytest.approx(1.0)
    m.advance(1.0)
    assert gov.poll() is None and applied == [1]  # still busy: no change, apply not called again
    m.others = 0.0
    m.advance(1.0)
    assert gov.poll() == 2 and applied == [1, 2]


def test_governor_without_proc_stat_does_nothing():
    gov = ThreadGovernor(limit=2, cores=2, apply=lambda n: pytest.fail("applied"), clock=lambda: 5.0,
                         machine=lambda: None)
    assert gov.poll() is None and gov.current == 2


def test_read_proc_stat_sums_busy_and_total_ticks(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 10 50 800 40 5 5 0 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    hz = os.sysconf("SC_CLK_TCK")
    busy, total = read_proc_stat(str(stat))
    assert busy == pytest.approx((100 + 10 + 50 + 5 + 5) / hz) and total == pytest.approx(1010 / hz)
    stat.write_text("intr 1 2 3\n")
    assert read_proc_stat(str(stat)) is None
    assert read_proc_stat(str(tmp_path / "absent")) is None


def test_for_torch_is_off_when_disabled_or_single_threaded(monkeypatch):
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setenv("OPENGLM_ADAPTIVE_THREADS", "0")
        assert ThreadGovernor.for_torch() is None
        monkeypatch.setenv("OPENGLM_ADAPTIVE_THREADS", "1")
        gov = ThreadGovernor.for_torch()
        assert gov is not None and gov.limit == min(2, threads.usable_cores())
        torch.set_num_threads(1)
        assert ThreadGovernor.for_torch() is None
    finally:
        torch.set_num_threads(before)


def test_quiet_wait_policy_sets_a_short_spin_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    threads.quiet_wait_policy()
    assert os.environ["GOMP_SPINCOUNT"] == threads.SPINCOUNT
    monkeypatch.setenv("GOMP_SPINCOUNT", "123")
    threads.quiet_wait_policy()
    assert os.environ["GOMP_SPINCOUNT"] == "123"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    threads.quiet_wait_policy()
    assert "GOMP_SPINCOUNT" not in os.environ
