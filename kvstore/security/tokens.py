"""Client tokens: who is calling (a tenant) and what it may do (a role).

A token file is TOML::

    [[token]]
    sha256 = "<hex of sha256(token)>"   # or, for convenience, token = "..."
    tenant = "acme"
    role = "write"                      # read < write < admin

    [tenant.acme]
    max_bytes = "4GiB"                  # capacity its namespaces may reserve
    max_namespaces = 8

The node keeps only the SHA-256 of each token and finds a caller's token by
the hash of what it sent, so a lookup takes the same time whatever the
token's bytes (no byte-by-byte comparison of secrets). The file is re-read
when its mtime or size changes, checked at most every ``recheck_s``
seconds: tokens rotate without a restart. A broken new file keeps the old
tokens and logs an error.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
import tomllib
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from kvstore.errors import InvalidArgument, PermissionDenied, Unauthenticated, shown
from kvstore.units import parse_size

log = logging.getLogger(__name__)

ROLES = ("read", "write", "admin")  # each allows everything the ones before it allow
NODE = "node"  # a peer proven by the cluster secret: cluster calls, not client ones
_RANK = {role: i for i, role in enumerate(ROLES)}
TENANT_SEPARATOR = "/"  # between a tenant and its namespace in the node's internal names
MAX_TOKEN_BYTES = 4096
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,63}")  # namespace characters, less the separator


@dataclass(frozen=True)
class Principal:
    """An authenticated caller: its tenant ("" in development mode) and role."""

    tenant: str
    role: str

    def allows(self, need: str) -> bool:
        """Whether this role may do what ``need`` (a role name) may do.
        ``node`` allows only ``node``; the client roles nest."""
        if self.role == NODE or need == NODE:
            return self.role == need
        return _RANK.get(self.role, -1) >= _RANK.get(need, len(ROLES))


DEVELOPMENT = Principal("", "admin")  # no token file: everything allowed, names unqualified
# The caller of the gRPC call being served, set by the server's auth interceptor
# (None: no interceptor set one; a node with a token file then refuses the call).
CALLER: ContextVar[Principal | None] = ContextVar("kvstore_caller", default=None)


@dataclass(frozen=True)
class Quota:
    """What one tenant's namespaces may take on a node (None: no limit)."""

    max_bytes: int | None = None
    max_namespaces: int | None = None


UNLIMITED = Quota()


@dataclass(frozen=True)
class _Table:
    by_hash: dict[bytes, Principal]
    quotas: dict[str, Quota]


def token_hash(token: str | bytes) -> str:
    """The hex SHA-256 a token file stores for ``token``."""
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).hexdigest()


def _check_tenant(name: Any, where: str) -> str:
    if not isinstance(name, str) or not _TENANT.fullmatch(name):
        raise ValueError(f"{where}: a tenant is 1-64 letters, digits and '._:@+-', starting with a letter or digit")
    return name


def _parse_token(i: int, entry: Any) -> tuple[bytes, Principal]:
    where = f"token #{i + 1}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: must be a table")
    unknown = set(entry) - {"sha256", "token", "tenant", "role", "name"}
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    if ("sha256" in entry) == ("token" in entry):
        raise ValueError(f"{where}: give exactly one of sha256, token")
    if "token" in entry:
        if not isinstance(entry["token"], str) or not entry["token"]:
            raise ValueError(f"{where}: token must be a non-empty string")
        digest = hashlib.sha256(entry["token"].encode()).digest()
    else:
        try:
            digest = bytes.fromhex(entry["sha256"])
        except (TypeError, ValueError):
            digest = b""
        if len(digest) != 32:
            raise ValueError(f"{where}: sha256 must be 64 hex digits")
    role = entry.get("role")
    if role not in ROLES:
        raise ValueError(f"{where}: role must be one of {', '.join(ROLES)}")
    return digest, Principal(_check_tenant(entry.get("tenant"), where), role)


def _parse_quota(tenant: str, entry: Any) -> Quota:
    where = f"tenant {tenant!r}"
    if not isinstance(entry, dict) or set(entry) - {"max_bytes", "max_namespaces"}:
        raise ValueError(f"{where}: only max_bytes and max_namespaces may be set")
    max_bytes = parse_size(entry["max_bytes"]) if "max_bytes" in entry else None
    count = entry.get("max_namespaces")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
        raise ValueError(f"{where}: max_namespaces must be an integer >= 0")
    return Quota(max_bytes, count)


def parse_tokens(text: str) -> _Table:
    """A token file's content as a table; ValueError says what is wrong (never a token)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"not valid TOML: {exc}") from None
    unknown = set(doc) - {"token", "tenant"}
    if unknown:
        raise ValueError(f"unknown top-level keys {sorted(unknown)} (use [[token]] and [tenant.NAME])")
    tokens = doc.get("token", [])
    if not isinstance(tokens, list):
        raise ValueError("token must be an array of tables ([[token]])")
    by_hash: dict[bytes, Principal] = {}
    for i, entry in enumerate(tokens):
        digest, principal = _parse_token(i, entry)
        if digest in by_hash and by_hash[digest] != principal:
            raise ValueError(f"token #{i + 1}: the same token is listed twice with different tenants or roles")
        by_hash[digest] = principal
    tenants = doc.get("tenant", {})
    if not isinstance(tenants, dict):
        raise ValueError("tenant must be a table of tables ([tenant.NAME])")
    quotas = {_check_tenant(name, f"tenant {name!r}"): _parse_quota(name, q) for name, q in tenants.items()}
    return _Table(by_hash, quotas)


class TokenStore:
    """The tokens of one token file, re-read when the file changes."""

    def __init__(self, path: str, recheck_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._recheck_s = recheck_s
        self._clock = clock
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._checked = float("-inf")
        self._table = self._read()  # a broken file at start is an error the caller sees
        self.reloads = 0

    @classmethod
    def from_config(cls, config: Any) -> "TokenStore | None":
        """The store of ``config.token_file``, or None when unset (development mode)."""
        return cls(config.token_file) if getattr(config, "token_file", "") else None

    def _file_stamp(self) -> tuple[int, int, int]:
        st = os.stat(self.path)
        return st.st_mtime_ns, st.st_size, st.st_ino

    def _read(self) -> _Table:
        stamp = self._file_stamp()
        with open(self.path, encoding="utf-8") as f:
            text = f.read()
        try:
            table = parse_tokens(text)
        except ValueError as exc:
            raise ValueError(f"token file {self.path}: {exc}") from None
        self._stamp = stamp
        self._checked = self._clock()
        return table

    def _refresh(self) -> _Table:
        now = self._clock()
        if now - self._checked < self._recheck_s:
            return self._table
        with self._lock:
            if now - self._checked < self._recheck_s:
                return self._table
            self._checked = now
            try:
                if self._file_stamp() == self._stamp:
                    return self._table
                self._table = self._read()
                self.reloads += 1
                log.info("token file %s re-read: %d tokens, %d tenants with quotas", self.path,
                         len(self._table.by_hash), len(self._table.quotas))
            except (OSError, ValueError, UnicodeDecodeError) as exc:
                try:
                    self._stamp = self._file_stamp()  # log a broken file once, not every second
                except OSError:
                    pass
                log.error("token file %s not re-read, the previous tokens stay in force: %s", self.path, exc)
            return self._table

    def authenticate(self, token: str | bytes | None) -> Principal:
        """The principal of ``token``; Unauthenticated when there is none or
        it is not in the file (the message never repeats the token)."""
        table = self._refresh()
        if not token:
            raise Unauthenticated("this node requires a client token (authorization: Bearer <token>)")
        raw = token.encode() if isinstance(token, str) else bytes(token)
        if len(raw) > MAX_TOKEN_BYTES:
            raise Unauthenticated("the client token is not valid on this node")
        digest = hashlib.sha256(raw).digest()
        principal = table.by_hash.get(digest)
        if principal is None:
            raise Unauthenticated("the client token is not valid on this node")
        return principal

    def quota(self, tenant: str) -> Quota:
        """The tenant's quota (no limit when its ``[tenant.NAME]`` is absent)."""
        return self._refresh().quotas.get(tenant, UNLIMITED)


def bearer(value: str | bytes | None) -> str:
    """The token of an ``authorization`` metadata value ("Bearer <token>"), or ""."""
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if not value:
        return ""
    scheme, _, token = value.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


# ---- tenant-qualified namespace names ----------------------------------------------------
# With tokens, a tenant's namespace "m" is "TENANT/m" inside the node (its pool,
# the directory, peers' calls), so two tenants never share a name or a page.
# Development mode (tenant "") keeps names as the client gave them.
def qualify(principal: Principal, name: str) -> str:
    """The node's internal name of the caller's namespace ``name``."""
    if not principal.tenant:
        return name
    if not isinstance(name, str) or TENANT_SEPARATOR in name:
        raise InvalidArgument(f"bad namespace name {shown(name)}: {TENANT_SEPARATOR!r} is reserved "
                              f"(names are per tenant)")
    return f"{principal.tenant}{TENANT_SEPARATOR}{name}" if name else ""


def namespace_for(principal: Principal | None, name: str, need: str) -> str:
    """For a data path that authenticated its caller once (HELLO): the internal
    name of the caller's namespace ``name`` if its role allows ``need``
    (``principal`` None: a node without tokens, ``name`` as given)."""
    if principal is None:
        return name
    if not principal.allows(need):
        raise PermissionDenied(f"this needs a token with the {need} role; this one has {principal.role}")
    return qualify(principal, name)


def owns(principal: Principal, internal: str) -> bool:
    """Whether the internal name ``internal`` is one of the caller's namespaces."""
    return not principal.tenant or internal.startswith(principal.tenant + TENANT_SEPARATOR)


def unqualify(principal: Principal, internal: str) -> str:
    """The name the caller knows for its namespace ``internal``."""
    if not principal.tenant:
        return internal
    return internal[len(principal.tenant) + 1:] if owns(principal, internal) else internal
