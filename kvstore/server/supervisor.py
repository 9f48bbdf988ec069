"""Telling a service manager how the node is doing: systemd's notify protocol, without libsystemd.

Under a ``Type=notify`` unit, systemd sets ``NOTIFY_SOCKET`` (a unix datagram socket; a leading ``@``
names one in the abstract namespace) and, with ``WatchdogSec=``, ``WATCHDOG_USEC`` (and
``WATCHDOG_PID``). ``kvstored`` then sends, as ``sd_notify(3)`` does:

* ``READY=1`` (with ``MAINPID`` and a ``STATUS`` line) once every server listens and health says
  SERVING, so units ordered after it start against a node that answers;
* ``WATCHDOG=1`` every half watchdog period, from the event loop itself: a loop that stops turning
  (a stuck tick, a blocking call) stops the pings, and systemd restarts the node;
* ``STOPPING=1`` when a graceful stop begins.

Without ``NOTIFY_SOCKET`` every call does nothing. A send that fails is logged once and never raises:
the node's service does not depend on its supervisor listening.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)


class Supervisor:
    """The service manager's side channel, read from the environment (module doc)."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        path = env.get("NOTIFY_SOCKET", "")
        self.address = "\0" + path[1:] if path.startswith("@") else path
        self.watchdog_s = 0.0
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_s = int(usec) / 1e6
        self._warned = False

    @property
    def active(self) -> bool:
        return bool(self.address)

    def notify(self, **fields: object) -> bool:
        """Send ``KEY=value`` lines (``notify(READY=1, STATUS="...")``); False if nobody got them."""
        if not self.address:
            return False
        message = "\n".join(f"{key}={value}" for key, value in fields.items()).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto(message, self.address)
            return True
        except OSError as exc:
            if not self._warned:
                log.warning("service manager notification to %s failed: %s", self.address.lstrip("\0"), exc)
                self._warned = True
            return False

    def ready(self, status: str) -> None:
        self.notify(READY=1, MAINPID=os.getpid(), STATUS=status)

    def stopping(self) -> None:
        self.notify(STOPPING=1, STATUS="stopping")

    async def keep_alive(self) -> None:
        """Ping the watchdog every half period while the event loop turns (runs until cancelled)."""
        if not self.active or self.watchdog_s <= 0:
            return
        while True:
            self.notify(WATCHDOG=1)
            await asyncio.sleep(self.watchdog_s / 2)
