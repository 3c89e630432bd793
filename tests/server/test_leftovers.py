"""kvd.server.leftovers: a lost client's shared-memory files go only when nothing holds them.

Files in a temporary directory (the rule does not depend on /dev/shm): a file whose flock
another open file holds stays; once released it goes; a file replaced under the same name
(another inode) stays, and so does a symlink put in its place; a file already gone is no
error. ``identify`` skips paths that do not exist.
"""

from __future__ import annotations

import fcntl
import os

from kvd.server import leftovers


def test_a_held_file_stays_and_goes_once_released(tmp_path):
    path = tmp_path / "kvd-pool-1-aa"
    path.write_bytes(b"x" * 64)
    files = leftovers.identify([path, tmp_path / "missing"])
    assert [f[0] for f in files] == [str(path)]
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a live process holds it
    try:
        assert leftovers.remove_abandoned(files) == 0 and path.exists()
    finally:
        os.close(fd)
    assert leftovers.remove_abandoned(files) == 1 and not path.exists()
    assert leftovers.remove_abandoned(files) == 0  # gone already: no error


def test_another_file_under_the_name_or_a_link_stays(tmp_path):
    path = tmp_path / "kvd-flags-1-bb"
    path.write_bytes(b"old")
    files = leftovers.identify([path])
    os.link(path, tmp_path / "old")  # the old inode lives on: the new file cannot reuse it
    path.unlink()
    path.write_bytes(b"new")  # another inode now
    assert leftovers.remove_abandoned(files) == 0 and path.read_bytes() == b"new"
    target = tmp_path / "precious"
    target.write_bytes(b"keep")
    files = leftovers.identify([path])
    path.unlink()
    path.symlink_to(target)
    assert leftovers.remove_abandoned(files) == 0 and path.is_symlink() and target.exists()
