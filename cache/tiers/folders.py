"""Folder checks of the disk tier: which folders may be attached at run time (`POST /admin/tiers`),
and whether the folder a tier indexed is still the one there (`identity`).

The configured folder is trusted: it comes from the operator's file or command line. A folder
named over HTTP is not: it must be absolute (a relative one would resolve against the server's
working folder), it must not be, or lie inside, a system folder, and when ``allowed_root`` is set
(`[cache.disk] allowed_root`) it must lie inside that. Links are resolved first, so neither a link
nor ``..`` can lead out.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

#: Folders of the operating system a cache must never be written into (nor anything below them).
#: Not /var/lib: services keep their state there (docs/CONTRACT.md's example folder is one).
SYSTEM_FOLDERS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/run",
                  "/sbin", "/sys", "/usr", "/var/log", "/var/mail", "/var/run", "/var/spool")


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def attachable_folder(path: str, allowed_root: str | None = None) -> Path:
    """``path`` resolved, if a disk tier may be attached there; ValueError saying why not."""
    if not path or not os.path.isabs(path):
        raise ValueError(f"the disk tier's path must be absolute, got {path!r}")
    resolved = os.path.realpath(path)
    if resolved == "/":
        raise ValueError("the disk tier cannot use the root folder /")
    for folder in SYSTEM_FOLDERS:
        if _inside(resolved, folder) or _inside(resolved, os.path.realpath(folder)):
            raise ValueError(f"the disk tier cannot use {path!r}: it lies in the system folder {folder}")
    if allowed_root is not None:
        root = os.path.realpath(allowed_root)
        if not _inside(resolved, root):
            raise ValueError(f"the disk tier's path must lie inside [cache.disk] allowed_root {allowed_root!r}, "
                             f"got {path!r}")
    return Path(resolved)


def identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the folder at ``path``, None if there is none (a link is not one)."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino) if stat.S_ISDIR(info.st_mode) else None
