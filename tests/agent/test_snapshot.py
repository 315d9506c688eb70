import os
import stat
import subprocess

import pytest

from openglm.agent.snapshot import Snapshots


def tree_of(root) -> dict:
    """Every file/symlink under root (outside .git) -> (content or link target, executable bit)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != ".git"]
        for name in filenames:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = ("link", os.readlink(p))
            else:
                out[rel] = (open(p, "rb").read(), bool(os.stat(p).st_mode & stat.S_IXUSR))
    return out


def write(root, rel, data: bytes | str = "x"):
    p = os.path.join(root, rel)
    os.makedirs(os.path.dirname(p), exist_ok=True)
    with open(p, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def test_rollback_restores_added_modified_deleted_exactly(tmp_path, workspace):
    for i in range(20):
        write(workspace, f"pkg/mod{i}.py", f"v = {i}\n")
    write(workspace, "bin/run.sh", "#!/bin/sh\necho hi\n")
    os.chmod(workspace / "bin/run.sh", 0o755)
    write(workspace, "data.bin", bytes(range(256)) * 10)
    os.symlink("pkg/mod1.py", workspace / "link.py")
    snaps = Snapshots(workspace, tmp_path / "snap.git")
    before = tree_of(workspace)
    first = snaps.take("step 1")

    write(workspace, "pkg/mod3.py", "v = 'changed'\n")  # modified
    os.remove(workspace / "pkg/mod4.py")  # deleted
    write(workspace, "new/deep/file.txt", "added")  # added, in new directories
    os.chmod(workspace / "bin/run.sh", 0o644)  # mode change
    os.remove(workspace / "link.py")
    os.symlink("pkg/mod2.py", workspace / "link.py")  # retargeted link
    second = snaps.take("step 2")
    after = tree_of(workspace)
    assert second != first
    assert {s for s, _ in snaps.changed_files(first, second)} == {"A", "M", "D"}

    snaps.restore(first)
    assert tree_of(workspace) == before
    assert not (workspace / "new").exists()  # emptied directories are gone too
    snaps.restore(second)
    assert tree_of(workspace) == after


def test_unchanged_workspace_keeps_the_same_snapshot(tmp_path, workspace):
    write(workspace, "a.txt", "a")
    snaps = Snapshots(workspace, tmp_path / "snap.git")
    a = snaps.take()
    assert snaps.take() == a
    again = Snapshots(workspace, tmp_path / "snap.git")  # reopened (a resumed worker) sees the same head
    assert again.head == a and again.take() == a


def test_user_git_and_ignored_paths_are_never_touched(tmp_path, workspace):
    subprocess.run(["git", "init", "-q", str(workspace)], check=True)
    write(workspace, "src.py", "1")
    write(workspace, ".venv/lib/site.py", "venv")
    write(workspace, "__pycache__/x.pyc", "cache")
    git_before = tree_of(workspace / ".git")
    snaps = Snapshots(workspace, tmp_path / "snap.git")
    first = snaps.take()
    write(workspace, "src.py", "2")
    write(workspace, ".venv/lib/site.py", "venv changed")
    snaps.take()
    snaps.restore(first)
    assert (workspace / "src.py").read_text() == "1"
    assert (workspace / ".venv/lib/site.py").read_text() == "venv changed"  # ignored: not stored, not reverted
    assert tree_of(workspace / ".git") == git_before  # the user's repository is untouched
    assert subprocess.run(["git", "-C", str(workspace), "status", "--porcelain"], capture_output=True,
                          text=True).stdout.count("src.py") == 1


def test_snapshot_stores_only_the_change(tmp_path, workspace):
    for i in range(300):
        write(workspace, f"d{i % 10}/f{i}.txt", f"content {i}\n" * 20)
    snaps = Snapshots(workspace, tmp_path / "snap.git")

    def objects():
        return sum(len(files) for _, _, files in os.walk(tmp_path / "snap.git" / "objects"))

    snaps.take()
    base = objects()
    assert base > 300
    for i in range(3):
        write(workspace, f"d{i}/f{i}.txt", f"changed {i}\n")
    snaps.take()
    # 3 new blobs + 3 changed directory trees + the root tree + 1 commit: nothing else is stored
    assert objects() - base == 8


def test_stale_index_lock_after_a_kill_is_cleared(tmp_path, workspace):
    write(workspace, "a", "1")
    snaps = Snapshots(workspace, tmp_path / "snap.git")
    first = snaps.take()
    (tmp_path / "snap.git" / "index.lock").write_text("")  # what a SIGKILL during `git add` leaves
    write(workspace, "a", "2")
    assert snaps.take() != first


# ---- dirty-path tracking (inotify): a snapshot stages only what changed, and never misses a change ----

def watched(tmp_path, workspace, files: dict[str, str]):
    """Writes `files`, takes a first snapshot (always a full add: the new watcher knows no past) and spies
    on the full adds after it. Returns (snaps, first snapshot id, recorded full adds)."""
    for path, text in files.items():
        write(workspace, path, text)
    snaps = Snapshots(workspace, tmp_path / "snap.git")
    first = snaps.take()
    return snaps, first, spy_full_adds(snaps)


def spy_full_adds(snaps) -> list:
    """Records every `git add -A .` (a full rescan) the snapshots run from now on."""
    calls, git = [], snaps._git
    def spy(*args, **kw):
        if args[:2] == ("add", "-A") and args[-1] == ".":
            calls.append(args)
        return git(*args, **kw)
    snaps._git = spy
    return calls


def files_at(snaps, sha) -> dict:
    out = snaps._git("ls-tree", "-r", sha)
    return {line.split("\t", 1)[1]: line.split()[2] for line in out.splitlines()}


def test_changes_by_a_subprocess_are_staged_without_a_rescan(tmp_path, workspace):
    for i in range(5):
        write(workspace, f"pkg/m{i}.py", f"v = {i}\n")
    snaps, first, full = watched(tmp_path, workspace, {"old.txt": "old", "gone/a.txt": "a"})
    script = ("echo changed > pkg/m1.py && rm pkg/m2.py && mv old.txt new.txt && chmod +x pkg/m3.py"
              " && mkdir -p n1/n2/n3 && echo deep > n1/n2/n3/f.txt && rm -r gone && echo tmp > t && rm t")
    subprocess.run(["sh", "-c", script], cwd=workspace, check=True)
    second = snaps.take()
    assert full == []  # staged from the tracked paths only
    assert sorted(snaps.changed_files(first, second)) == [
        ("A", "n1/n2/n3/f.txt"), ("A", "new.txt"), ("D", "gone/a.txt"), ("D", "old.txt"), ("D", "pkg/m2.py"),
        ("M", "pkg/m1.py"), ("M", "pkg/m3.py")]
    # a file created inside the new nested directory after its watch exists is seen too
    write(workspace, "n1/n2/n3/g.txt", "g")
    third = snaps.take()
    assert snaps.changed_files(second, third) == [("A", "n1/n2/n3/g.txt")] and full == []
    assert snaps.take() == third  # nothing changed: the same snapshot, no git call needed


def test_a_renamed_directory_is_staged_by_a_rescan(tmp_path, workspace):
    snaps, first, full = watched(tmp_path, workspace, {"pkg/sub/a.py": "a", "b.py": "b"})
    os.rename(workspace / "pkg", workspace / "lib")  # every watch below it now has a stale path
    second = snaps.take()
    assert sorted(snaps.changed_files(first, second)) == [("A", "lib/sub/a.py"), ("D", "pkg/sub/a.py")]
    write(workspace, "lib/sub/a.py", "changed")  # watched again, under the new name
    third = snaps.take()
    assert len(full) == 1 and snaps.changed_files(second, third) == [("M", "lib/sub/a.py")]


def test_rollback_writes_do_not_confuse_the_tracker(tmp_path, workspace):
    write(workspace, "a.txt", "1")
    write(workspace, "d/b.txt", "1")
    snaps = Snapshots(workspace, tmp_path / "snap.git")
    first = snaps.take()
    write(workspace, "a.txt", "2")
    write(workspace, "e/c.txt", "new")
    os.remove(workspace / "d/b.txt")
    second = snaps.take()
    full = spy_full_adds(snaps)
    snaps.restore(first)
    assert tree_of(workspace) == {"a.txt": (b"1", False), "d/b.txt": (b"1", False)}
    assert snaps.take() == first  # the restore's own writes change nothing
    write(workspace, "d/b.txt", "3")  # a change right after a rollback is seen
    third = snaps.take()
    assert snaps.changed_files(first, third) == [("M", "d/b.txt")]
    snaps.restore(second)
    assert tree_of(workspace) == {"a.txt": (b"2", False), "e/c.txt": (b"new", False)}
    assert full == []


def test_files_a_rollback_recreated_and_the_next_step_deleted_leave_the_snapshot(tmp_path, workspace):
    write(workspace, "keep.txt", "k")
    write(workspace, "backup/app.py", "a")
    snaps = Snapshots(workspace, tmp_path / "snap.git")
    first = snaps.take()
    subprocess.run(["rm", "-r", "backup"], cwd=workspace, check=True)
    second = snaps.take()
    snaps.restore(first)  # git writes backup/ back (and into the index)
    subprocess.run(["rm", "-r", "backup"], cwd=workspace, check=True)  # before backup/ had a watch
    assert snaps.take() == second


def test_a_change_made_while_nothing_watched_is_in_the_next_snapshot(tmp_path, workspace):
    write(workspace, "a.txt", "1")
    snaps = Snapshots(workspace, tmp_path / "snap.git")
    first = snaps.take()
    snaps.close()  # the worker is gone (killed, restarted)
    write(workspace, "a.txt", "2")
    write(workspace, "new/b.txt", "b")
    again = Snapshots(workspace, tmp_path / "snap.git")
    second = again.take()
    assert sorted(again.changed_files(first, second)) == [("A", "new/b.txt"), ("M", "a.txt")]
    # and restore right after a restart sees the unsnapshotted change too (it is dropped)
    write(workspace, "a.txt", "3")
    third = Snapshots(workspace, tmp_path / "snap.git")
    third.restore(first)
    assert tree_of(workspace) == {"a.txt": (b"1", False)}


def test_an_index_whose_shared_part_was_lost_is_rebuilt(tmp_path, workspace):
    write(workspace, "a.txt", "1")
    snaps = Snapshots(workspace, tmp_path / "snap.git")
    first = snaps.take()
    snaps.close()
    for shared in (tmp_path / "snap.git").glob("sharedindex.*"):  # what a kill inside git can leave
        shared.unlink()
    write(workspace, "a.txt", "2")
    again = Snapshots(workspace, tmp_path / "snap.git")
    again.restore(first)
    assert tree_of(workspace) == {"a.txt": (b"1", False)}
    write(workspace, "b.txt", "b")
    assert again.changed_files(first, again.take()) == [("A", "b.txt")]


def test_odd_file_names_are_staged(tmp_path, workspace):
    snaps, first, full = watched(tmp_path, workspace, {})
    names = ["-n", "*", "sp ace", ":(glob)x", "new\nline", "\udcff-not-utf8"]
    for name in names:
        with open(os.path.join(os.fsencode(workspace), os.fsencode(name)), "wb") as f:
            f.write(b"x")
    second = snaps.take()
    assert len(snaps.changed_files(first, second)) == len(names)
    for name in names:
        os.remove(os.path.join(os.fsencode(workspace), os.fsencode(name)))
    assert snaps.changed_files(first, snaps.take()) == [] and full == []


def test_queue_overflow_falls_back_to_a_full_add(tmp_path, workspace):
    write(workspace, "a.txt", "1")
    write(workspace, "b.txt", "1")
    write(workspace, "late.txt", "1")
    snaps = Snapshots(workspace, tmp_path / "snap.git")
    first = snaps.take()
    full = spy_full_adds(snaps)
    limit = int(open("/proc/sys/fs/inotify/max_queued_events").read())
    fa, fb = open(workspace / "a.txt", "ab"), open(workspace / "b.txt", "ab")
    for _ in range(limit // 2 + 10):  # alternating files: the kernel cannot merge the events
        fa.write(b"x"), fa.flush(), fb.write(b"y"), fb.flush()
    fa.close(), fb.close()
    write(workspace, "late.txt", "2")  # its events are lost in the overflow
    second = snaps.take()
    assert len(full) == 1
    assert sorted(snaps.changed_files(first, second)) == [("M", "a.txt"), ("M", "b.txt"), ("M", "late.txt")]
    write(workspace, "late.txt", "3")  # after the full add, tracking goes on
    snaps.take()
    assert len(full) == 1


def test_watch_limit_falls_back_to_full_adds(tmp_path, workspace, monkeypatch):
    import errno

    from inotify_simple import INotify
    snaps, first, full = watched(tmp_path, workspace, {"a.txt": "1"})

    def no_more_watches(self, path, mask):
        raise OSError(errno.ENOSPC, "inotify watch limit reached")
    monkeypatch.setattr(INotify, "add_watch", no_more_watches)
    write(workspace, "new/x.txt", "x")  # its directory cannot be watched
    second = snaps.take()
    write(workspace, "new/x.txt", "changed, unwatched")
    third = snaps.take()
    assert len(full) == 2  # both rescans: the tracker gave up
    assert files_at(snaps, third)["new/x.txt"] != files_at(snaps, second)["new/x.txt"]
    assert snaps.changed_files(first, second) == [("A", "new/x.txt")]


def test_without_inotify_every_snapshot_is_a_full_add(tmp_path, workspace, monkeypatch):
    from openglm.agent import watch
    monkeypatch.setattr(watch, "INotify", None)
    write(workspace, "a.txt", "1")
    snaps = Snapshots(workspace, tmp_path / "snap.git")
    full = spy_full_adds(snaps)
    first = snaps.take()
    write(workspace, "a.txt", "2")
    second = snaps.take()
    assert len(full) == 2 and snaps.changed_files(first, second) == [("M", "a.txt")]


def test_ignored_and_user_git_directories_get_no_watch(tmp_path, workspace):
    from openglm.agent.watch import DirtyPaths
    subprocess.run(["git", "init", "-q", str(workspace)], check=True)
    for rel in ["src/a.py", ".venv/lib/site.py", "node_modules/x/y.js", "src/__pycache__/a.pyc", "docs/x.md"]:
        write(workspace, rel, "1")
    write(workspace, ".gitignore", "*.log\n")
    dirty = DirtyPaths(workspace, [".venv/", "node_modules/", "__pycache__/", "*.pyc"])
    assert sorted(dirty._wds.values()) == ["", "docs", "src"]
    assert dirty.drain() is None  # a new watcher cannot vouch for the past
    write(workspace, ".venv/lib/site.py", "2")
    write(workspace, "src/b.pyc", "2")
    write(workspace, "src/a.py", "2")
    subprocess.run(["git", "-C", str(workspace), "commit", "-q", "--allow-empty", "-m", "x"], check=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "a", "GIT_AUTHOR_EMAIL": "a@a",
                        "GIT_COMMITTER_NAME": "a", "GIT_COMMITTER_EMAIL": "a@a"})
    assert dirty.drain() == {"src/a.py": False}
    dirty.close()


def test_paths_a_user_gitignore_ignores_are_skipped_without_a_rescan(tmp_path, workspace):
    snaps, first, full = watched(tmp_path, workspace, {".gitignore": "*.log\nbuild/\n", "src/a.py": "1"})
    write(workspace, "src/run.log", "log")
    write(workspace, "build/out/o.bin", "bin")
    write(workspace, "src/a.py", "2")
    second = snaps.take()
    assert full == [] and snaps.changed_files(first, second) == [("M", "src/a.py")]


@pytest.mark.parametrize("mtime", [1e9, 4e9])  # long ago; in the future: racily clean entries, which
def test_the_split_index_is_folded_when_its_changed_part_grows(tmp_path, workspace, mtime):  # git keeps split
    def write_old(rel, text):
        write(workspace, rel, text)
        os.utime(workspace / rel, (mtime, mtime))
    for i in range(400):
        write_old(f"d{i // 100}/f{i}.txt", f"{i}\n")
    snaps = Snapshots(workspace, tmp_path / "snap.git")
    snaps.FOLD_BYTES = 1024
    folds, git = [], snaps._git
    snaps._git = lambda *args, **kw: (folds.append(args) if args[0] == "update-index" else None) or git(*args, **kw)
    snaps.take()
    shared = list((tmp_path / "snap.git").glob("sharedindex.*"))
    for step in range(8):  # every entry rewritten: each lands in the split part
        for i in range(step * 50, step * 50 + 50):
            write_old(f"d{i // 100}/f{i}.txt", f"{i} changed\n")
        sha = snaps.take()
        assert len(list((tmp_path / "snap.git").glob("sharedindex.*"))) == 1  # the old one is deleted
    assert 1 <= len(folds) <= 2  # folded, but not at every step (racy entries stay in the split part)
    assert mtime > 2e9 or list((tmp_path / "snap.git").glob("sharedindex.*")) != shared
    again = Snapshots(workspace, tmp_path / "snap.git")
    assert again.take() == sha  # the folded index still matches the workspace
