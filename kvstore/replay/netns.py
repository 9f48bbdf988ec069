"""Real kernel links for the replay: one Linux network namespace per node, a bridge, ``tc``.

:class:`NetnsLinks` (a context manager; needs root and iproute2) builds, for
one run with a unique tag:

* a bridge ``kvb<tag>`` in the caller's namespace, address ``P.254/24``
  (the harness's side: it reaches every node over it);
* per node *i* a namespace ``kvstore-<tag>-<i>`` with ``lo`` and ``eth0``
  (``P.<i+1>/24``), one end of a veth pair whose other end ``kvh<tag><i>``
  is a bridge port;
* ``P`` is a /24 inside the benchmarking range 198.18.0.0/15 that no
  interface here uses yet. No namespace has a default route: traffic never
  leaves the bridge.

Shaping, both directions of each node's link (HTB + netem, iproute2):
``eth0`` inside the namespace carries the node's egress, the bridge port
carries its ingress. Each gets an HTB class at the link rate with a netem
leaf for the one-way latency; traffic to or from the harness's address
(``P.254``: an engine's calls to its own node, the harness's own lookups)
goes to an unshaped class, so only node-to-node bytes are shaped.

Everything is removed on exit, on errors and on Ctrl-C: the namespaces (their
veth pairs go with them) and the bridge. Names carry the tag, so concurrent
runs never touch each other's links.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field

RANGE = ipaddress.ip_network("198.18.0.0/15")
UNSHAPED_BIT = "40gbit"


def available() -> str:
    """'' when netns links can be built here, else why not."""
    if os.geteuid() != 0:
        return "--network netns needs root (ip netns, tc); run as root or use --network shaped"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"--network netns needs iproute2 ({tool} not found): apt-get install -y iproute2"
    return ""


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(args), capture_output=True, text=True)
    if check and proc.returncode:
        raise RuntimeError(f"{' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of 198.18.0.0/15 that no interface on this machine has an address in."""
    used = _run("ip", "-4", "-o", "addr", "show").stdout
    subnets = list(RANGE.subnets(new_prefix=24))
    start = secrets.randbelow(len(subnets))
    for k in range(len(subnets)):
        net = subnets[(start + k) % len(subnets)]
        prefix = str(net.network_address).rsplit(".", 1)[0] + "."
        if f" {prefix}" not in used:
            return net
    raise RuntimeError("no free /24 left in 198.18.0.0/15")


@dataclass
class NetnsLinks:
    """``with NetnsLinks(nodes, rate, latency) as links: links.exec_prefix(i), links.address(i)``."""

    nodes: int
    rate_bytes_s: float
    latency_s: float = 0.0
    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    subnet: ipaddress.IPv4Network | None = None
    _made_ns: list[str] = field(default_factory=list)
    _made_bridge: bool = False

    # ---- names -----------------------------------------------------------
    @property
    def bridge(self) -> str:
        return f"kvb{self.tag}"

    def ns(self, i: int) -> str:
        return f"kvstore-{self.tag}-{i}"

    def address(self, i: int) -> str:
        """Node ``i``'s address (it listens there for gRPC, data channel, transport, metrics)."""
        assert self.subnet is not None
        return str(self.subnet.network_address + i + 1)

    @property
    def harness_address(self) -> str:
        assert self.subnet is not None
        return str(self.subnet.network_address + 254)

    def exec_prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns(i)]

    def describe(self) -> dict[str, object]:
        return {"kind": "netns", "subnet": str(self.subnet), "bridge": self.bridge,
                "namespaces": [self.ns(i) for i in range(self.nodes)], "rate_bytes_s": self.rate_bytes_s,
                "latency_s": self.latency_s, "shaping": "tc htb + netem on each node's veth, both directions"}

    # ---- lifecycle ---------------------------------------------------------
    def __enter__(self) -> "NetnsLinks":
        why = available()
        if why:
            raise RuntimeError(why)
        if not 1 <= self.nodes <= 250:
            raise ValueError("netns links: 1..250 nodes")
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        self.subnet = self.subnet or _free_subnet()
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._made_bridge = True
        _run("ip", "addr", "add", f"{self.harness_address}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for i in range(self.nodes):
            ns, host, peer = self.ns(i), f"kvh{self.tag}{i}", f"kvp{self.tag}{i}"
            _run("ip", "netns", "add", ns)
            self._made_ns.append(ns)
            _run("ip", "link", "add", host, "type", "veth", "peer", "name", peer)
            _run("ip", "link", "set", peer, "netns", ns)
            _run("ip", "link", "set", host, "master", self.bridge)
            _run("ip", "link", "set", host, "up")
            inside = ["ip", "netns", "exec", ns]
            _run(*inside, "ip", "link", "set", "lo", "up")
            _run(*inside, "ip", "link", "set", peer, "name", "eth0")
            _run(*inside, "ip", "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _run(*inside, "ip", "link", "set", "eth0", "up")
            self._shape([*inside, "tc"], "eth0", "dst")     # the node's egress
            self._shape(["tc"], host, "src")                # the node's ingress (bridge -> node)

    def _shape(self, tc: list[str], dev: str, harness_field: str) -> None:
        """HTB on ``dev``: node-to-node traffic at the link rate (+ netem latency), harness traffic unshaped."""
        rate = f"{max(8.0, self.rate_bytes_s * 8):.0f}bit"
        burst = f"{max(16 * 1024, int(self.rate_bytes_s * 0.002))}b"  # 2 ms of the rate: smooth at any speed
        _run(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10")
        _run(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate", rate,
             "ceil", rate, "burst", burst, "cburst", burst)
        _run(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:20", "htb", "rate", UNSHAPED_BIT)
        if self.latency_s > 0:
            _run(*tc, "qdisc", "add", "dev", dev, "parent", "1:10", "handle", "10:", "netem", "delay",
                 f"{self.latency_s * 1e6:.0f}us", "limit", "100000")
        _run(*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
             "match", "ip", harness_field, f"{self.harness_address}/32", "flowid", "1:20")

    def close(self) -> None:
        """Remove every namespace and the bridge this object made; safe to call twice."""
        for i, ns in reversed(list(enumerate(self._made_ns))):
            _run("ip", "netns", "del", ns, check=False)
            if _run("ip", "link", "show", f"kvh{self.tag}{i}", check=False).returncode == 0:
                _run("ip", "link", "del", f"kvh{self.tag}{i}", check=False)  # a veth not yet moved
        self._made_ns.clear()
        if self._made_bridge:
            _run("ip", "link", "del", self.bridge, check=False)
            self._made_bridge = False
