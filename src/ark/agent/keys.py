"""Key files: an agent's CURVE key pair in ZeroMQ's certificate format.

``NAME.key`` holds the public key, ``NAME.key_secret`` both keys. The secret file is
created with mode 0600 in the same system call that creates it (never written first and
restricted after), and renamed into place, so no other user can ever read it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import zmq

_BANNER = "#   ZeroMQ CURVE {kind} Certificate (ark keygen)\n\n"


def _write_private(path: Path, text: str, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _cert(kind: str, public: str, secret: str | None) -> str:
    text = _BANNER.format(kind=kind) + f'metadata\ncurve\n    public-key = "{public}"\n'
    if secret is not None:
        text += f'    secret-key = "{secret}"\n'
    return text


def create_keypair(directory: str | Path, name: str) -> tuple[str, Path]:
    """Write ``NAME.key`` and ``NAME.key_secret`` in ``directory``; returns (public key, secret file)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    public, secret = (k.decode() for k in zmq.curve_keypair())
    _write_private(d / f"{name}.key", _cert("Public", public, None), 0o644)
    _write_private(d / f"{name}.key_secret", _cert("**Secret**", public, secret), 0o600)
    return public, d / f"{name}.key_secret"


def public_key(path: str | Path) -> str:
    """The public key in a ``.key`` or ``.key_secret`` file."""
    import zmq.auth

    pub, _ = zmq.auth.load_certificate(str(path))
    return str(pub.decode())
