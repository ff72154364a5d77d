"""Key files: an agent's CURVE key pair in ZeroMQ's certificate format, and its signing key.

``NAME.key`` holds the public key, ``NAME.key_secret`` both keys. The secret file is
created with mode 0600 in the same system call that creates it (never written first and
restricted after), and renamed into place, so no other user can ever read it.

The Ed25519 key that signs the agent's messages is derived from the CURVE secret key
(BLAKE2b, keyed with a fixed label), so there is no second secret to keep; its public
half goes into the cluster file as ``sign_key``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path
from typing import NamedTuple

import nacl.bindings
import nacl.exceptions
import nacl.signing
import zmq

_BANNER = "#   ZeroMQ CURVE {kind} Certificate (ark keygen)\n\n"
_SIGN_LABEL = b"ark-sign-v1"


class KeyPair(NamedTuple):
    public_key: str  # CURVE, 40 Z85 characters
    sign_key: str  # Ed25519 verify key, 64 hex digits
    secret_file: Path


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


def signing_key(curve_secret: bytes) -> nacl.signing.SigningKey:
    """The Ed25519 key derived from a CURVE secret key, given as the bytes of its Z85 text
    (as key files hold it): the same secret in another form derives another key."""
    return nacl.signing.SigningKey(hashlib.blake2b(curve_secret, key=_SIGN_LABEL, digest_size=32).digest())


def create_keypair(directory: str | Path, name: str) -> KeyPair:
    """Write ``NAME.key`` and ``NAME.key_secret`` in ``directory``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    public, secret = (k.decode() for k in zmq.curve_keypair())
    _write_private(d / f"{name}.key", _cert("Public", public, None), 0o644)
    _write_private(d / f"{name}.key_secret", _cert("**Secret**", public, secret), 0o600)
    return KeyPair(public, signing_key(secret.encode()).verify_key.encode().hex(), d / f"{name}.key_secret")


def public_keys(path: str | Path) -> KeyPair:
    """The public and signing keys of a ``.key_secret`` file."""
    import zmq.auth

    pub, sec = zmq.auth.load_certificate(str(path))
    if sec is None:
        raise ValueError(f"{path}: holds no secret key")
    return KeyPair(pub.decode(), signing_key(sec).verify_key.encode().hex(), Path(path))


class Signatures:
    """Sign this host's messages; check another host's (its ``sign_key`` from the cluster file)."""

    def __init__(self, curve_secret: bytes, verify_keys: dict[int, str | None]) -> None:
        self._secret = bytes(signing_key(curve_secret)._signing_key)  # libsodium's 64-byte form
        self._verify = {h: bytes.fromhex(k) for h, k in verify_keys.items() if k is not None}

    def sign(self, data: bytes) -> bytes:
        return bytes(nacl.bindings.crypto_sign(data, self._secret)[:64])

    def verify(self, host: int, data: bytes, signature: bytes) -> bool:
        key = self._verify.get(host)
        if key is None or len(signature) != 64:
            return False
        try:
            nacl.bindings.crypto_sign_open(signature + data, key)
        except (nacl.exceptions.BadSignatureError, ValueError):
            return False
        return True
