"""One typed error family, translated to a gRPC status at the boundary.

Node logic raises these; the gRPC service and the data channel turn them into
status codes with the message intact, so a client sees a code and a sentence,
never a stack trace.
"""

from __future__ import annotations

from typing import Any

import grpc

MAX_MESSAGE = 300  # longest error message sent to a client, in characters


def bounded(message: str, limit: int = MAX_MESSAGE) -> str:
    """``message`` cut to ``limit`` characters (an error text leaving the node)."""
    return message if len(message) <= limit else message[:limit - 1] + "\u2026"


def shown(value: Any, limit: int = 40) -> str:
    """A client's input as an error message may quote it: its repr, cut to
    about ``limit`` characters, with its full length when it was cut."""
    text = repr(value[:limit] if isinstance(value, (str, bytes)) else value)
    if isinstance(value, (str, bytes)) and len(value) > limit:
        return f"{text}... ({len(value)} {'chars' if isinstance(value, str) else 'bytes'})"
    return bounded(text, limit + 10)


class KvError(Exception):
    """Base of every error the node reports to a client."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(KvError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(KvError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(KvError):
    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhausted(KvError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(KvError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(KvError):
    """A transfer ran past its deadline (e.g. a Put whose bytes never came)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unauthenticated(KvError):
    """No credentials, or credentials this node does not accept (a bad token, a forged peer)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(KvError):
    """Authenticated, but this caller may not do this (another tenant's namespace, a read-only token)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class PoolExhausted(ResourceExhausted):
    """No free or evictable slot: every page is pinned or being read."""


_BY_VALUE = {cls.code.value[0]: cls for cls in (InvalidArgument, NotFound, AlreadyExists, ResourceExhausted, Unavailable,
                                               DeadlineExceeded, Unauthenticated, PermissionDenied)}


def error_for_code(code: int, message: str) -> KvError:
    """Rebuild a typed error from a numeric status code (data channel replies)."""
    cls = _BY_VALUE.get(code, KvError)
    err = cls(message)
    if cls is KvError:
        err.code = next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
    return err
