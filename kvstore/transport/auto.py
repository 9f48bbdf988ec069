"""Pick the peer transport by name, with an ``auto`` choice.

``auto`` -> ``ucx`` when ``ucxx`` imports, else ``tcp``. The check is only
an import: it creates no UCX context and opens no listener (a UCX that
imports but cannot listen fails loudly at ``start``). Since UCX reads some
options when its library loads, the check first applies the daemon's UCX
defaults (:func:`kvstore.transport.ucx.configure_ucx_env`) to ``os.environ``
where the operator has not set them.
"""

from __future__ import annotations

import os

from kvstore.transport.base import Transport

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


def resolve_transport(name: str = "auto") -> str:
    """``auto`` -> ``ucx`` when ucxx imports, else ``tcp``; explicit names are
    checked (``ucx`` without ucxx raises RuntimeError)."""
    if name not in TRANSPORTS:
        raise ValueError(f"unknown transport {name!r}: {', '.join(TRANSPORTS)}")
    if name == "tcp":
        return "tcp"
    if _ucxx_available():
        return "ucx"
    if name == "ucx":
        raise RuntimeError("--transport ucx asked for, but ucxx is not installed or does not import "
                           "(pip install ucxx-cu12), or use --transport tcp")
    return "tcp"


def make_transport(name: str = "auto") -> Transport:
    """A new, unstarted transport of the resolved kind."""
    if resolve_transport(name) == "ucx":
        from kvstore.transport.ucx import UcxTransport

        return UcxTransport()
    from kvstore.transport.tcp import TcpTransport

    return TcpTransport()
