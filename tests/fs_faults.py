"""File-system faults for tests: directories that even root cannot write into, and
small file systems that fill up."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path


def make_read_only(directory: Path) -> Callable[[], None] | None:
    """Make ``directory`` unwritable; returns the undo, or None where that cannot work.

    As root, mode bits are not enforced; the immutable attribute (``chattr +i``) is.
    """
    directory.chmod(0o500)
    try:
        (directory / "probe").touch()
    except PermissionError:
        return lambda: directory.chmod(0o700)
    (directory / "probe").unlink()
    directory.chmod(0o700)
    chattr = shutil.which("chattr")
    if not chattr or subprocess.run([chattr, "+i", str(directory)], capture_output=True).returncode:
        return None
    return lambda: subprocess.run([chattr, "-i", str(directory)], check=True)


def mount_small_tmpfs(directory: Path, nbytes: int) -> Callable[[], None] | None:
    """Mount a tmpfs of ``nbytes`` on ``directory``; returns the unmount, or None where
    mounting is not allowed (not root, no mount namespace rights)."""
    directory.mkdir(parents=True, exist_ok=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", str(directory)]
    if subprocess.run(mount, capture_output=True).returncode:
        return None
    return lambda: subprocess.run(["umount", str(directory)], check=True)
