"""Pick the peer transport by name, with an ``auto`` choice.

``auto`` -> ``ucx`` when ``ucxx`` imports, else ``tcp``. The check is only
an import: it creates no UCX context and opens no listener (a UCX that
imports but cannot listen fails loudly at ``start``). Since UCX reads some
options when its library loads, the check first applies the daemon's UCX
defaults (:func:`kvstore.transport.ucx.configure_ucx_env`) to ``os.environ``
where the operator has not set them.

Security: UCX here carries neither TLS nor the HELLO proof of the cluster
secret, so a node whose peer plane is secured (``secure``: it has a TLS
certificate or a cluster secret) gets TCP from ``auto``, and an explicit
``ucx`` is refused unless ``insecure`` (then UCX must run only on trusted
interfaces: see docs/security.md).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from kvstore.transport.base import Transport

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "ucx", "tcp")


def _ucxx_available() -> bool:
    from kvstore.transport.ucx import configure_ucx_env, ucx_context_created

    if not ucx_context_created():
        # UCX reads some options when libucs loads: set the defaults first.
        configure_ucx_env(os.environ)
    try:
        import ucxx  # noqa: F401
    except Exception:  # ImportError, or a broken install failing at import (e.g. missing libucx)
        return False
    return True


def resolve_transport(name: str = "auto", *, secure: bool = False, insecure: bool = False) -> str:
    """``auto`` -> ``ucx`` when ucxx imports, else ``tcp``; explicit names are
    checked (``ucx`` without ucxx raises RuntimeError). ``secure`` (TLS or a
    cluster secret on this node): ``auto`` -> ``tcp``, and ``ucx`` raises
    RuntimeError unless ``insecure``."""
    if name not in TRANSPORTS:
        raise ValueError(f"unknown transport {name!r}: {', '.join(TRANSPORTS)}")
    if name == "tcp" or (secure and name == "auto"):
        return "tcp"
    if secure:
        if not insecure:
            raise RuntimeError("--transport ucx cannot carry TLS or the cluster secret's proof: use --transport "
                               "tcp (or auto) on a node with --tls-cert/--cluster-secret-file, or pass --insecure "
                               "and keep UCX on trusted interfaces only")
        log.warning("INSECURE: --transport ucx on a secured node: peer page pulls are neither encrypted nor "
                    "authenticated; run UCX only on trusted interfaces")
    if _ucxx_available():
        return "ucx"
    if name == "ucx":
        raise RuntimeError("--transport ucx asked for, but ucxx is not installed or does not import "
                           "(pip install ucxx-cu12), or use --transport tcp")
    return "tcp"


def make_transport(name: str = "auto", *, secure: bool = False, insecure: bool = False, **tcp: Any) -> Transport:
    """A new, unstarted transport of the resolved kind; ``tcp``: the TCP
    transport's TLS and proof options (:class:`~kvstore.transport.tcp.TcpTransport`)."""
    if resolve_transport(name, secure=secure, insecure=insecure) == "ucx":
        from kvstore.transport.ucx import UcxTransport

        return UcxTransport()
    from kvstore.transport.tcp import TcpTransport

    return TcpTransport(**tcp)
