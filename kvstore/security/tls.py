"""TLS for every port of a node, and for the clients and peers that call it.

One set of files (``--tls-cert``, ``--tls-key``, ``--tls-ca``) serves every
port: gRPC (clients and the cluster service), the data channel, the TCP
peer transport and metrics. The files are re-read when they change: gRPC
asks :func:`grpc_server_credentials`' fetcher on each new connection, the
socket ports take their context from :class:`ReloadingContext` per accepted
connection, so new connections see new files and open ones keep theirs.

Names: a node's certificate carries the node's listen host as a subject
alternative name (an IP SAN for an address, a DNS SAN for a name), because
its peers dial it by the address it advertises and verify that name; a
client verifies the host of the address it dials, or ``server_name``.
Peers dial each other with their own node certificate as the client
certificate, so mTLS (``--tls-client-auth``) holds between nodes too.

:class:`TlsStream` runs TLS over a non-blocking socket with the loop's own
``sock_recv_into``/``sock_sendall`` and memory BIOs: asyncio's
``sock_recv_into`` does not take SSL sockets, and streams copy more.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from kvstore.config import NodeConfig

log = logging.getLogger(__name__)

MIN_VERSION = ssl.TLSVersion.TLSv1_2
_RECORD_IN = 256 << 10  # ciphertext read from the socket at a time
_RECORD_OUT = 256 << 10  # plaintext encrypted and sent at a time


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """The PEM files of one side: its certificate chain and key (optional
    for a client), the CA bundle it verifies peers against ("": the system's),
    and whether a server requires client certificates."""

    cert: str = ""
    key: str = ""
    ca: str = ""
    client_auth: bool = False

    @classmethod
    def of(cls, config: NodeConfig) -> "TlsFiles | None":
        """A node's files, or None when it has no certificate (plaintext)."""
        if not config.tls:
            return None
        return cls(config.tls_cert, config.tls_key, config.tls_ca, config.tls_client_auth)

    def paths(self) -> tuple[str, ...]:
        return tuple(p for p in (self.cert, self.key, self.ca) if p)

    def stamp(self) -> tuple[tuple[int, int], ...]:
        """(mtime_ns, size) of each file: changes when a file is replaced."""
        out = []
        for path in self.paths():
            try:
                st = os.stat(path)
                out.append((st.st_mtime_ns, st.st_size))
            except OSError:
                out.append((-1, -1))
        return tuple(out)


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


# ---- ssl contexts ------------------------------------------------------------------

def server_context(files: TlsFiles, *, require_client_cert: bool | None = None) -> ssl.SSLContext:
    """A server context: TLS 1.2+, the node's certificate; client
    certificates verified against ``files.ca`` and required when
    ``require_client_cert`` (default: ``files.client_auth``)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = MIN_VERSION
    ctx.load_cert_chain(files.cert, files.key)
    require = files.client_auth if require_client_cert is None else require_client_cert
    if files.ca:
        ctx.load_verify_locations(cafile=files.ca)
        ctx.verify_mode = ssl.CERT_REQUIRED if require else ssl.CERT_OPTIONAL
    elif require:
        raise ValueError("requiring client certificates needs a CA bundle (--tls-ca)")
    return ctx


def client_context(ca: str = "", cert: str = "", key: str = "") -> ssl.SSLContext:
    """A client context: TLS 1.2+, the server verified (chain against ``ca``,
    or the system's CAs, and its name), ``cert``/``key`` presented when given."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca or None)
    ctx.minimum_version = MIN_VERSION
    if cert:
        ctx.load_cert_chain(cert, key or None)
    return ctx


def peer_context(files: TlsFiles) -> ssl.SSLContext:
    """How a node dials its peers: verifying them against the cluster CA,
    presenting its own node certificate."""
    return client_context(files.ca, files.cert, files.key)


class ReloadingContext:
    """An :class:`ssl.SSLContext` rebuilt when one of its files changes.

    :meth:`get` stats the files (three ``stat`` calls) and rebuilds the
    context if any changed; a rebuild that fails (a cert replaced before its
    key) keeps the previous context and is tried again on the next call."""

    def __init__(self, files: TlsFiles, build: Callable[[TlsFiles], ssl.SSLContext]) -> None:
        self._files, self._build = files, build
        self._stamp = files.stamp()
        self._ctx = build(files)

    def get(self) -> ssl.SSLContext:
        stamp = self._files.stamp()
        if stamp != self._stamp:
            try:
                self._ctx = self._build(self._files)
            except (OSError, ssl.SSLError, ValueError) as exc:
                log.warning("TLS files changed but do not load (%s); keeping the previous ones", exc)
            else:
                self._stamp = stamp
                log.info("TLS: reloaded %s", ", ".join(self._files.paths()))
        return self._ctx


# ---- gRPC credentials ----------------------------------------------------------------

def _grpc_config(files: TlsFiles) -> grpc.ServerCertificateConfiguration:
    server_context(files, require_client_cert=False)  # the pair must load: a broken one is not served
    ca = _read(files.ca) if files.ca else None
    return grpc.ssl_server_certificate_configuration([(_read(files.key), _read(files.cert))], root_certificates=ca)


def grpc_server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """Server credentials that re-read the files when they change: gRPC calls
    the fetcher for each new connection; it answers None (keep) unless a file's
    mtime or size moved and the new files load."""
    state = {"stamp": files.stamp()}

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        stamp = files.stamp()
        if stamp == state["stamp"]:
            return None
        try:
            config = _grpc_config(files)
        except (OSError, ssl.SSLError, ValueError) as exc:
            log.warning("gRPC TLS files changed but do not load (%s); keeping the previous ones", exc)
            return None
        state["stamp"] = stamp
        log.info("gRPC TLS: reloaded %s", ", ".join(files.paths()))
        return config

    return grpc.dynamic_ssl_server_credentials(_grpc_config(files), fetch,
                                               require_client_authentication=files.client_auth)


def grpc_channel_credentials(ca: str = "", cert: str = "", key: str = "") -> grpc.ChannelCredentials:
    """Channel credentials: verify the server against ``ca`` (else the
    system's CAs), present ``cert``/``key`` when given (mTLS)."""
    return grpc.ssl_channel_credentials(root_certificates=_read(ca) if ca else None,
                                        private_key=_read(key) if key else None,
                                        certificate_chain=_read(cert) if cert else None)


def grpc_name_options(server_name: str | None) -> list[tuple[str, str]]:
    """Channel options that verify ``server_name`` instead of the dialled host."""
    return [("grpc.ssl_target_name_override", server_name)] if server_name else []


# ---- TLS over a non-blocking socket ---------------------------------------------------

class TlsStream:
    """TLS on a non-blocking socket, driven through memory BIOs by the loop's
    ``sock_recv_into``/``sock_sendall`` (so it runs on asyncio and uvloop).

    :meth:`recv_into` decrypts straight into the caller's buffer (a pool
    slot): ciphertext lands in one reused buffer, plaintext only in the
    target. One task uses a stream at a time, as frames are served in order."""

    __slots__ = ("sock", "_obj", "_in", "_out", "_buf", "_view")

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, *, server_side: bool,
                 server_hostname: str | None = None) -> None:
        self.sock = sock
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._obj = context.wrap_bio(self._in, self._out, server_side=server_side, server_hostname=server_hostname)
        self._buf = bytearray(_RECORD_IN)
        self._view = memoryview(self._buf)

    @classmethod
    async def wrap(cls, loop: asyncio.AbstractEventLoop, sock: socket.socket, context: ssl.SSLContext, *,
                   server_side: bool, server_hostname: str | None = None,
                   timeout: float | None = None) -> "TlsStream":
        """Handshake on ``sock`` within ``timeout`` seconds; raises
        :class:`ssl.SSLError` (an OSError) or TimeoutError."""
        stream = cls(sock, context, server_side=server_side, server_hostname=server_hostname)
        async with asyncio.timeout(timeout):
            await stream._handshake(loop)
        return stream

    async def _handshake(self, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            try:
                self._obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._flush(loop)
                if not await self._fill(loop):
                    raise ssl.SSLEOFError("peer closed the connection during the TLS handshake") from None
        await self._flush(loop)

    async def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._out.pending:
            await loop.sock_sendall(self.sock, self._out.read())

    async def _fill(self, loop: asyncio.AbstractEventLoop) -> int:
        n = await loop.sock_recv_into(self.sock, self._view)
        if n:
            self._in.write(self._view[:n])
        else:
            self._in.write_eof()
        return n

    def peer_cert(self) -> dict | None:  # type: ignore[type-arg]
        return self._obj.getpeercert()

    async def recv_into(self, loop: asyncio.AbstractEventLoop, view: memoryview) -> int:
        """Decrypt up to ``view.nbytes`` bytes into ``view``: what is there
        once at least one byte is; 0 when the peer closed."""
        total, want = 0, view.nbytes
        while total < want:
            try:
                n = self._obj.read(want - total, view[total:])
            except ssl.SSLWantReadError:
                if total:
                    return total
                await self._flush(loop)  # e.g. a TLS 1.3 key update wants an answer
                await self._fill(loop)
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return total
            if n == 0:
                return total
            total += n
        return total

    async def sendall(self, loop: asyncio.AbstractEventLoop, data: bytes | bytearray | memoryview) -> None:
        """Encrypt and send ``data``, a record batch at a time."""
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        for start in range(0, view.nbytes, _RECORD_OUT):
            self._obj.write(view[start:start + _RECORD_OUT])
            await loop.sock_sendall(self.sock, self._out.read())

    def close(self) -> None:
        self.sock.close()


# ---- which credentials a node needs where ----------------------------------------------

class RefusedToStart(RuntimeError):
    """A node asked to listen beyond loopback without the credentials that needs."""


def listen_mode(config: NodeConfig) -> str:
    """How a node may run with its listen address and credentials:
    ``secure`` (TLS, client tokens and a cluster secret), ``development``
    (anything less, on loopback only) or ``insecure`` (less, beyond loopback,
    with ``--insecure``). Raises :class:`RefusedToStart` naming what is
    missing otherwise."""
    if config.secured:
        return "secure"
    if config.loopback_only:
        return "development"
    if config.insecure:
        return "insecure"
    missing = [what for what, have in (("TLS (--tls-cert and --tls-key)", config.tls),
                                       ("client tokens (--token-file)", bool(config.token_file)),
                                       ("a cluster secret (--cluster-secret-file)", bool(config.cluster_secret_file)))
               if not have]
    raise RefusedToStart(f"refusing to listen on {config.listen} (beyond loopback) without {', '.join(missing)}; "
                         f"set them, listen on 127.0.0.1 for development, or pass --insecure (never in production)")
