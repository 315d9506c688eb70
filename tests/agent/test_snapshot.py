import os
import stat
import subprocess

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
