"""Writing files so that a reader (or a crash) never sees half of one, and no one a password.

`write_atomic` writes a whole file through a temporary sibling named `.NAME.PID-XXXX.tmp` and a rename;
the PID in the name lets the next write to the same path remove the temporary files of a process that
was killed mid-write (SIGKILL, a power cut), which nothing else would. `append_line` appends a whole
line or nothing.

`hide_passwords` shows the password of every URL in a text as `***`: what headsearch prints, writes or records
(a storage URL, an error naming one, a command line) goes through it, for storage URLs carry database passwords
and run directories are shared.
"""
from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path


HIDDEN = "***"  # a hidden password, as SQLAlchemy shows one (`URL.render_as_string(hide_password=True)`)
# scheme://, then the rest of the URL up to a space, a quote or a bracket (a URL quoted in a message, its repr).
_URL = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<rest>[^\s'\"<>()\[\]]*)")
# A password given as a query parameter (libpq takes `password=`, the MySQL drivers `passwd=` or `password=`), or
# in a libpq connection string ("host=h user=u password=p").
_QUERY_PASSWORD = re.compile(r"(?P<key>(?:^|(?<=[?&;\s]))(?:password|passwd|pwd)=)[^&#\s'\"]*", re.IGNORECASE)


def hide_passwords(text: str) -> str:
    """`text` with the password of every URL in it replaced by `***`: `postgresql://user:***@host/db`, SQLAlchemy's
    form, for any scheme (redis://:***@host too), and `?password=***` (`passwd`, `pwd`) in a query or a libpq
    connection string. The user and the rest of the URL stay as written, so a masked URL still says which storage
    it is. The password ends at the URL's last `@` (urllib's reading; SQLAlchemy's is the first), so an unescaped
    `@` in a password hides more, never less. Hidden text is unchanged: masking twice is masking once."""
    return _QUERY_PASSWORD.sub(rf"\g<key>{HIDDEN}", _URL.sub(_hide_userinfo_password, text))


def _hide_userinfo_password(m: re.Match) -> str:
    userinfo, at, host = m["rest"].rpartition("@")
    user, colon, _ = userinfo.partition(":")
    if not at or not colon or "/" in user:  # no userinfo, no password in it, or an "@" further down the path
        return m[0]
    return f"{m['scheme']}{user}:{HIDDEN}@{host}"


def nearest_existing(path: Path) -> Path:
    """`path` itself if it exists, else its nearest ancestor that does (the top of the path when none does)."""
    return next((p for p in (path, *path.parents) if p.exists()), Path(path.anchor))


def folder_problem(root: Path, purpose: str) -> str | None:
    """What stops `root` being (or becoming, with its missing parents) a writable folder for `purpose`, as
    the rest of a sentence that starts with the option and `root`, advice included; None if nothing."""
    root = Path(root)
    existing = nearest_existing(root)
    if existing.exists() and not existing.is_dir():
        what = "is a file" if existing == root else f"is inside {existing}, which is a file"
        return f" {what}: give a folder for {purpose}"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f": {existing} is not writable, give another folder"
    return None


def file_problem(path: Path, purpose: str) -> str | None:
    """What stops `path` being written (created, or replaced) as the file of `purpose`, its missing folders
    made first: as `folder_problem`'s, the rest of a sentence that starts with the option and `path`; None if
    nothing. An existing file is no problem (it is replaced whole)."""
    path = Path(path)
    if path.is_dir():
        return f" is a folder: give the path of a file for {purpose}, e.g. {path / 'out.json'}"
    existing = nearest_existing(path.parent)
    if existing.exists() and not existing.is_dir():
        return f" is inside {existing}, which is a file: give a path in a folder for {purpose}"
    if not os.access(existing, os.W_OK | os.X_OK):  # the file is replaced through a temporary file beside it
        return f": {existing} is not writable, give a path in another folder"
    return None


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write to a temporary file in the same folder, then rename: readers never see half a file."""
    path = Path(path)
    remove_stale_temporaries(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; run files are meant to be shared
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        _name_file(e, path)
        raise


def _name_file(e: BaseException, path: Path) -> None:
    """Name the file `e` met (a write to a descriptor names none), so the one-line error can say which
    file met the full disk."""
    if isinstance(e, OSError) and e.filename is None:
        e.filename = str(path)


def remove_stale_temporaries(path: Path) -> list[Path]:
    """Remove the temporary files `write_atomic` left beside `path` in processes that no longer run
    (on this machine); a live process's write in progress is left alone. Returns what was removed."""
    path = Path(path)
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.(\d+)-[^/]*\.tmp$")
    removed = []
    try:
        siblings = list(path.parent.iterdir())
    except OSError:
        return removed
    for sibling in siblings:
        m = pattern.match(sibling.name)
        if m and not _process_alive(int(m.group(1))):
            try:
                sibling.unlink()
                removed.append(sibling)
            except OSError:
                pass
    return removed


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def append_line(path: Path, line: str) -> None:
    """Append `line` (a newline added) whole or not at all: a full disk mid-write is cut back off, so a
    reader of the file (one JSON record a line) never meets half a record."""
    data = memoryview((line.rstrip("\n") + "\n").encode())
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.lseek(fd, 0, os.SEEK_END)
        try:
            while data:
                data = data[os.write(fd, data):]
        except BaseException as e:
            os.ftruncate(fd, size)
            _name_file(e, path)
            raise
    finally:
        os.close(fd)
