"""Checks of paths given as flags, made before anything is written there."""

from __future__ import annotations

import os
import tempfile

from specserve.errors import ConfigError


def check_writable_dir(name: str, path: str) -> None:
    """`path` is a writable directory, or can be created as one: its nearest existing ancestor
    takes a file. Probed with an anonymous temporary file (access() says yes to root even on
    /proc); the directory itself is created by its user (the file tier)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ConfigError(f"{name}: {probe!r} is not a directory")
    st = os.stat(probe)
    if probe == os.path.abspath(path) and st.st_mode & 0o077 and st.st_uid != os.geteuid():
        raise ConfigError(f"{name}: {path!r} is open to other users and owned by another user; use a private directory")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as exc:
        what = "is not writable" if probe == os.path.abspath(path) else f"cannot be created in {probe!r}"
        raise ConfigError(f"{name}: {path!r} {what} ({exc.strerror or exc})") from None
