"""Whether a process still runs, and removing what processes that are gone left behind.

Several parts of asyncflow name the files they create after their process
(``<prefix><pid>-…``: a store server's private directory, a rank's kept
shared-memory segments, a weight transport's segments and temporary
directories), so that when one is killed (``SIGKILL``: no ``finally``, no
finalizer) the next one on the host can tell its leftovers from those of a
live process and remove them. This module is the one place that judges
"gone".
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended.

    - another user's process (``EPERM``) is alive: it exists, and the
      answer must never let a live owner's files be removed;
    - a zombie (ended, not yet reaped by its parent; Linux ``/proc``) is
      gone: it holds no file, mapping or lock any more;
    - pid reuse is not detected: a pid taken again by an unrelated process
      reads alive, so its predecessor's leftovers stay until that process
      ends too (a leak, never a removal of something in use);
    - ``pid <= 0`` names no single process (``kill(0, 0)`` would signal this
      process group): not alive.
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OverflowError:  # larger than any pid
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # "pid (comm) state ...": comm may hold spaces and parentheses, the state follows the last ")"
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True  # no /proc (not Linux), or it ended just now: judged by kill() alone


def sweep_dead(directory: str | Path, pattern: re.Pattern[str], *, directories: bool = False) -> list[str]:
    """Remove this user's entries of ``directory`` whose name ``pattern`` matches and whose process is gone.

    ``pattern.match(name).group(1)`` is the pid of the process that made
    the entry. Regular files are removed (``directories``: directories,
    with their contents); links, other users' entries and entries of live
    processes are left, and an entry that cannot be removed is passed over.
    Returns the paths removed.
    """
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        match = pattern.match(entry.name)
        if not match or pid_alive(int(match.group(1))):
            continue
        with contextlib.suppress(OSError):
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue  # /dev/shm and /tmp are shared: never touch what another user made
            if directories and entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            elif not directories and entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)
            else:
                continue
            removed.append(entry.path)
    return removed


__all__ = ["pid_alive", "sweep_dead"]
