"""Node identity by a shared cluster secret: HMAC proofs on cluster calls.

A peer signs each cluster call with :meth:`ClusterSecret.sign`; the callee
checks it with :meth:`ClusterSecret.verify`. A proof is one ASCII string::

    v1.<node id, base64url>.<unix time, ms>.<nonce, 32 hex>.<HMAC-SHA256, 64 hex>

The MAC covers the purpose (the called method), the node id, the time, the
nonce and the SHA-256 of the call's body, each length-prefixed, so a proof
made for one method or body does not pass for another. A proof is accepted
within ``window_s`` of the verifier's clock and once only: nonces seen in
the window are remembered (a bounded cache; when it overflows, the oldest
entries go and proofs as old as them are refused from then on, so an
evicted nonce cannot be replayed either).

Pure logic: the clock and the nonce source are injectable, nothing here
touches a socket.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from contextvars import ContextVar

from kvstore.errors import Unauthenticated

MIN_SECRET_BYTES = 16
WINDOW_S = 30.0
MAX_PROOF_CHARS = 512
_VERSION = "v1"
METADATA_KEY = "x-kvstore-peer"  # gRPC metadata of a cluster call: the caller's proof
# The proven node id of the cluster call being served (set by the server's auth interceptor).
PEER: ContextVar[str | None] = ContextVar("kvstore_peer", default=None)


def _field(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


class ClusterSecret:
    """The secret every member holds; signs and verifies proofs of membership."""

    def __init__(self, secret: bytes, window_s: float = WINDOW_S, clock: Callable[[], float] = time.time,
                 nonce: Callable[[], bytes] = lambda: os.urandom(16), max_nonces: int = 200_000) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the cluster secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
        self._key = secret
        self.window_s = window_s
        self._clock = clock
        self._nonce = nonce
        self._max_nonces = max_nonces
        self._seen: OrderedDict[bytes, int] = OrderedDict()  # nonce -> its proof's time (ms), oldest first
        self._floor_ms = -1  # proofs at or before this time are refused (their nonces may have been evicted)
        self._lock = threading.Lock()

    @classmethod
    def from_file(cls, path: str, **kwargs: object) -> "ClusterSecret":
        """The secret in ``path`` (surrounding whitespace ignored)."""
        with open(path, "rb") as f:
            secret = f.read().strip()
        try:
            return cls(secret, **kwargs)  # type: ignore[arg-type]
        except ValueError as exc:
            raise ValueError(f"cluster secret file {path}: {exc}") from None

    @classmethod
    def from_config(cls, config: object) -> "ClusterSecret | None":
        """The secret of ``config.cluster_secret_file``, or None when unset."""
        path = getattr(config, "cluster_secret_file", "")
        return cls.from_file(path) if path else None

    def _mac(self, purpose: str, node_id: str, ts_ms: int, nonce: bytes, body: bytes) -> bytes:
        msg = b"".join((_field(b"kvstore-peer-v1"), _field(purpose.encode()), _field(node_id.encode()),
                        struct.pack(">q", ts_ms), _field(nonce), hashlib.sha256(body).digest()))
        return hmac.new(self._key, msg, hashlib.sha256).digest()

    def sign(self, purpose: str, node_id: str, body: bytes = b"") -> str:
        """A fresh proof that ``node_id`` holds the secret, for one call."""
        ts_ms = int(self._clock() * 1000)
        nonce = self._nonce()
        mac = self._mac(purpose, node_id, ts_ms, nonce, body)
        who = base64.urlsafe_b64encode(node_id.encode()).decode().rstrip("=")
        return f"{_VERSION}.{who}.{ts_ms}.{nonce.hex()}.{mac.hex()}"

    def verify(self, proof: str | bytes | None, purpose: str, body: bytes = b"") -> str:
        """The node id a valid, fresh, unused proof names; Unauthenticated otherwise."""
        node_id, ts_ms, nonce, mac = _parse(proof)
        if not hmac.compare_digest(mac, self._mac(purpose, node_id, ts_ms, nonce, body)):
            raise Unauthenticated("peer proof rejected: wrong MAC (not signed with this cluster's secret, "
                                  "or for another call)")
        now_ms = int(self._clock() * 1000)
        if abs(now_ms - ts_ms) > self.window_s * 1000:
            raise Unauthenticated(f"peer proof rejected: its time is {abs(now_ms - ts_ms) / 1000:.0f} s away "
                                  f"from this node's clock (window ±{self.window_s:g} s)")
        with self._lock:
            self._forget(now_ms)
            if ts_ms <= self._floor_ms or nonce in self._seen:
                raise Unauthenticated("peer proof rejected: replayed")
            self._seen[nonce] = ts_ms
            while len(self._seen) > self._max_nonces:
                _, old = self._seen.popitem(last=False)
                self._floor_ms = max(self._floor_ms, old)
        return node_id

    def _forget(self, now_ms: int) -> None:
        """Drop nonces too old to pass the window check anyway."""
        limit = now_ms - int(self.window_s * 1000)
        while self._seen:
            nonce, ts = next(iter(self._seen.items()))
            if ts >= limit:
                break
            self._seen.popitem(last=False)

    @property
    def remembered(self) -> int:
        """How many nonces the replay cache holds (for tests and metrics)."""
        return len(self._seen)


def _parse(proof: str | bytes | None) -> tuple[str, int, bytes, bytes]:
    bad = Unauthenticated("peer proof rejected: missing or malformed")
    if isinstance(proof, bytes):
        try:
            proof = proof.decode("ascii")
        except UnicodeDecodeError:
            raise bad from None
    if not proof or len(proof) > MAX_PROOF_CHARS:
        raise bad
    parts = proof.split(".")
    if len(parts) != 5 or parts[0] != _VERSION:
        raise bad
    _, who, ts, nonce_hex, mac_hex = parts
    try:
        node_id = base64.urlsafe_b64decode(who + "=" * (-len(who) % 4)).decode()
        if not ts.isdigit() or len(ts) > 16:
            raise ValueError(ts)
        nonce, mac = bytes.fromhex(nonce_hex), bytes.fromhex(mac_hex)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise bad from None
    if not node_id or len(nonce) < 8 or len(mac) != 32:
        raise bad
    return node_id, int(ts), nonce, mac
