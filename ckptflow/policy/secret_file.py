"""Secret files named by the config (S3 keys, the Prefect auth string): readable by their owner only.

A secret in a file that others can read is a secret shared with every account on the machine. As
ssh does for private keys, ckptflow refuses such a file instead of using it silently; the error
names the file and the one command that fixes it. The mode is checked on the open file descriptor,
so the file checked is the file read.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class SecretFileError(ValueError):
    """A secret file that cannot be used; the message names the file and the fix, never its content."""


def read_secret_file(path: str | os.PathLike[str], what: str) -> str:
    """The text of ``path`` (``~`` expanded), which must be a regular file no one but its owner can
    read or write (mode 0600 or 0400). ``what`` says what it holds, for the error message."""
    shown = Path(os.path.expanduser(path))
    try:
        fd = os.open(shown, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise SecretFileError(f"{shown}: cannot read the {what} file ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SecretFileError(f"{shown}: the {what} file is not a regular file")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise SecretFileError(
                f"{shown}: the {what} file has mode {mode:04o}, so other accounts can read or change it; "
                f"refused. Make it private: chmod 600 {shown}"
            )
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    finally:
        os.close(fd)
    try:
        return b"".join(chunks).decode()
    except UnicodeDecodeError:
        raise SecretFileError(f"{shown}: the {what} file is not UTF-8 text") from None
