"""The shared plumbing: commands with a group-killing timeout, git run one way, bearer tokens."""

import sys
import time

import pytest

from openglm.util import proc
from openglm.util.auth import Access, access, allows, bearer_token, is_loopback
from openglm.util.git import GitError, apply_patch, git, init_repo, unified_diff


def _alive(pid: int) -> bool:
    return not proc.exited(pid)


def test_run_collects_output_status_and_input():
    r = proc.run([sys.executable, "-c", "import sys; print(sys.stdin.read().upper()); sys.exit(3)"], input="abc")
    assert (r.returncode, r.stdout.strip(), r.timed_out, r.ok) == (3, "ABC", False, False)
    merged = proc.run(["sh", "-c", "echo out; echo err >&2"], merge_stderr=True)
    assert merged.stdout.split() == ["out", "err"] and merged.stderr == ""
    raw = proc.run(["sh", "-c", "printf '\\377ok'"], text=False)
    assert raw.stdout == b"\xffok" and proc.run(["sh", "-c", "printf '\\377ok'"]).stdout == "\ufffdok"
    assert proc.run(["cat"]).stdout == ""  # no input: an empty stdin, never the caller's


def test_a_timeout_kills_the_whole_group_not_just_the_shell(tmp_path):
    pidfile = tmp_path / "child.pid"
    # sh starts a sleeping grandchild; a timeout that killed only sh would leave it running
    script = f"sleep 30 & echo $! > {pidfile}; echo started; wait"
    t0 = time.monotonic()
    r = proc.run(["sh", "-c", script], timeout=0.5)
    assert r.timed_out and r.returncode is None and "started" in r.stdout
    assert time.monotonic() - t0 < 10
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(child)


def test_stop_group_and_kill_tree_end_every_process():
    leader = proc.spawn(["sh", "-c", "sleep 30 & sleep 30 & wait"])
    time.sleep(0.2)
    members = [p.pid for p in proc.tree(leader.pid)]
    assert len(members) == 3
    proc.stop_group(leader.pid, grace_s=0.5)
    leader.wait(5)
    time.sleep(0.1)
    assert not any(_alive(pid) for pid in members)
    # kill_tree follows children that left the group (setsid): psutil walks parent links
    root = proc.spawn([sys.executable, "-c", "import os,subprocess,time; subprocess.Popen(['sleep','30'], "
                       "start_new_session=True); time.sleep(30)"])
    time.sleep(0.5)
    pids = proc.kill_tree(root.pid, timeout_s=2)
    root.wait(5)
    assert len(pids) == 2 and not any(_alive(pid) for pid in pids[1:])


def test_git_runs_one_way_and_fails_in_its_own_words(tmp_path):
    (tmp_path / "a.txt").write_text("one\n")
    sha = init_repo(tmp_path)
    assert len(sha) == 40 and git(tmp_path, "log", "-1", "--format=%an").strip() == "openglm"
    with pytest.raises(GitError, match="rev-parse.* in .* failed: fatal: Needed a single revision"):
        git(tmp_path, "rev-parse", "--verify", "no-such-rev^{commit}")
    assert git(tmp_path, "rev-parse", "--verify", "-q", "nothing", check=False) == ""


def test_apply_patch_git_first_then_fuzzy_patch_and_undo(tmp_path):
    (tmp_path / "f.py").write_text("a = 1\nb = 2\nc = 3\n")
    init_repo(tmp_path)
    ok, log = apply_patch(tmp_path, unified_diff("f.py", "a = 1\nb = 2\nc = 3\n", "a = 1\nb = 20\nc = 3\n"))
    assert ok and log.startswith("$ git apply") and (tmp_path / "f.py").read_text() == "a = 1\nb = 20\nc = 3\n"
    stale = unified_diff("f.py", "x = 0\na = 1\nb = 2\n", "x = 0\na = 1\nb = 3\n")  # context no longer matches
    ok, log = apply_patch(tmp_path, stale)
    assert not ok and "git apply" in log and "patch --batch" not in log  # fuzzy patching only when asked
    git(tmp_path, "commit", "-qam", "b = 20")
    fuzzy = unified_diff("f.py", "a = 1\nb = 20\nc = 3\n", "a = 1\nb = 21\nc = 3\n").replace("a = 1", "a = 9")
    ok, log = apply_patch(tmp_path, fuzzy, fuzz=True)  # git refuses the changed context; GNU patch fuzzes it
    assert ok and "patch --batch" in log and (tmp_path / "f.py").read_text() == "a = 1\nb = 21\nc = 3\n"
    git(tmp_path, "commit", "-qam", "b = 21")
    half = unified_diff("f.py", "a = 1\nb = 21\nc = 3\n", "a = 1\nb = 22\nc = 3\n") + \
        unified_diff("g.py", "zzz\n", "yyy\n")  # the first file applies, the second does not exist
    ok, log = apply_patch(tmp_path, half, fuzz=True)
    assert not ok and (tmp_path / "f.py").read_text() == "a = 1\nb = 21\nc = 3\n"  # the half applied is undone


def test_bearer_access_levels():
    assert bearer_token("Bearer abc") == bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") == bearer_token(None) == ""
    assert access(None, None) is Access.CONTROL  # nothing configured: an open server
    assert access("Bearer full", "full", "look") is Access.CONTROL
    assert access("Bearer look", "full", "look") is Access.VIEW
    for header in (None, "", "Bearer", "Bearer wrong", "Basic full", "full"):
        assert access(header, "full", "look") is Access.DENIED
    assert access("Bearer x", "full") is Access.DENIED and access("Bearer é", "full") is Access.DENIED
    assert allows(Access.VIEW, "get") and not allows(Access.VIEW, "POST") and allows(Access.CONTROL, "DELETE")
    assert not allows(Access.DENIED, "GET")
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1") and not is_loopback("example.com")
