"""A persistent, monotonic incarnation number per agent.

Peers ignore messages from an incarnation lower than the newest they have seen (a delayed
message from before a restart), so a restarted agent must never come back with a lower
one, whatever its clock does. The number is ``max(previous + 1, seconds since 2023-11-14)``:
the stored previous value makes it monotonic across clock steps back, and the clock makes
it grow even when the state file is lost. It is written (atomically, fsynced) before it
is used. Seconds since the epoch fit the 30 bits a node allows until 2057.

A missing file counts as 0: the clock alone then decides, which is safe only while the
clock is right and the host did not restart faster than once a second (either can leave
the lost value above the clock, and peers would ignore the agent until the clock passed
it). A file that is there but damaged (not 1 to 10 ASCII digits within the 30 bits, bytes
that are not text, a directory or anything else than a regular file) is refused, never
repaired: its value is unknown and may be such a value above the clock, and only the
operator can say the clock is right. Removing the file is that statement.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import time
from collections.abc import Callable
from pathlib import Path

EPOCH = 1_700_000_000  # 2023-11-14: incarnations count seconds from here
MAX_INCARNATION = 2**30 - 1
_DIGITS = re.compile(rb"[0-9]{1,10}")
_MAX_FILE_BYTES = 64  # digits plus any whitespace a hand edit may have left


class IncarnationError(RuntimeError):
    """The state file cannot be read or written."""


def next_incarnation(state_dir: str | Path, host: str, clock: Callable[[], float] = time.time) -> int:
    """Read the previous incarnation of ``host``, store and return the next one."""
    path = Path(state_dir) / f"{host}.incarnation"
    try:
        Path(state_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
        inc = max(_read(path) + 1, int(clock()) - EPOCH, 1)
        if inc > MAX_INCARNATION:
            raise IncarnationError(f"state_dir: incarnation {inc} of {host} exceeds {MAX_INCARNATION}; "
                                   f"reset {path} only when every peer has been restarted")
        _store(path, inc)
    except OSError as e:
        raise IncarnationError(f"state_dir: cannot keep {path}: {e.strerror}") from None
    return inc


def keep_epoch(state_dir: str | Path, name: str, epoch: int) -> int:
    """An arbiter's highest epoch led or heard of: store ``epoch`` if above the stored one,
    and return the larger. An arbiter stores each epoch it leads or hears of and starts
    from the stored value: it follows a leader of that epoch or above, and leads a
    generation above it, so that a restart never leads with an epoch hosts have seen (a
    missing file starts at 0: hosts then wait until they forget the old epoch)."""
    path = Path(state_dir) / f"{name}.epoch"
    try:
        Path(state_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
        prev = _read(path, "epoch")
        if epoch > prev:
            _store(path, epoch)
    except OSError as e:
        raise IncarnationError(f"state_dir: cannot keep {path}: {e.strerror}") from None
    return max(prev, epoch)


def _store(path: Path, value: int) -> None:
    """Written atomically and fsynced, the rename too, before the value is used."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{value}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    with contextlib.suppress(OSError):  # the rename itself must survive a crash
        dfd = os.open(path.parent, os.O_RDONLY)
        os.fsync(dfd)
        os.close(dfd)


def _read(path: Path, what: str = "incarnation") -> int:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return 0
    if not stat.S_ISREG(st.st_mode):  # a FIFO would block the read, a directory fail it
        raise IncarnationError(f"state_dir: {path} is not a regular file; expected one holding the last "
                               f"{what} (0..{MAX_INCARNATION}); remove it once this host's clock is right")
    with open(path, "rb") as f:
        raw = f.read(_MAX_FILE_BYTES + 1)  # what we write is at most 11 bytes: never read more
    # ASCII digits only: str.isdigit and int() also take other scripts' digits and
    # superscripts, which this program never writes.
    if len(raw) <= _MAX_FILE_BYTES and _DIGITS.fullmatch(raw.strip()) and int(raw) <= MAX_INCARNATION:
        return int(raw)
    raise IncarnationError(f"state_dir: {path} is damaged (holds {raw[:24]!r}; expected ASCII digits "
                           f"0..{MAX_INCARNATION}); remove it once this host's clock is right to start over")
