"""``kvstored``: run one kvstore node.

SIGTERM/SIGINT start a graceful stop: health goes NOT_SERVING, new calls are
refused, in-flight calls get ``--grace`` seconds, then the process exits 0.

Under systemd (``Type=notify``) the node reports READY once it serves, pings the
watchdog from its event loop and reports STOPPING (``kvstore.server.supervisor``;
``deploy/systemd/kvstored.service``).

A node asked to listen beyond loopback without TLS, client tokens and a
cluster secret exits 1 at once, naming what is missing, unless
``--insecure`` (docs/security.md).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys

from kvstore import __version__, tracing
from kvstore.errors import KvError
from kvstore.config import NodeConfig, add_arguments, build_config
from kvstore.loops import loop_factory, resolve_loop
from kvstore.placement import compiled_modules
from kvstore.server.app import NodeServer
from kvstore.server.supervisor import Supervisor

log = logging.getLogger("kvstored")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstored",
        description="kvstore node: holds KV-cache pages in a GPU (CuPy) or host (numpy) pool and serves them "
                    "over gRPC (kvstore.v1.KvStore + grpc.health.v1.Health) and a bulk TCP data channel.",
        epilog="Every flag can also be set in the --config TOML file or as KVSTORED_<NAME> in the environment; "
               "precedence: defaults < config file < environment < flags.",
    )
    parser.add_argument("--version", action="version", version=f"kvstored {__version__}")
    add_arguments(parser)
    return parser


async def serve(config: NodeConfig, ready: asyncio.Event | None = None) -> None:
    """Run a node until SIGTERM/SIGINT, then stop gracefully."""
    server = NodeServer(config)
    await server.start()
    # One line on stdout for scripts and tests that start us on port 0; mode:
    # secure, development (loopback without all credentials) or insecure.
    print(f"kvstored ready grpc={server.address} data_port={server.data_port} "
          f"metrics_port={server.metrics_port} node_id={server.node.node_id if server.node else ''} "
          f"mode={server.mode} tls={'on' if server.config.tls else 'off'}",
          flush=True)
    if ready is not None:
        ready.set()
    supervisor = Supervisor()
    supervisor.ready(f"serving gRPC on {server.address}, mode {server.mode}")
    watchdog = asyncio.get_running_loop().create_task(supervisor.keep_alive())
    # Start-up objects (modules, generated code) never die: keep them out of
    # the collector's generations so its pauses stay short on planner ticks.
    gc.freeze()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("signal received: stopping (grace %.1fs)", config.grace)
    supervisor.stopping()
    watchdog.cancel()
    await server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        config = build_config(args)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tracing.configure("kvstored", config.node_id or config.listen)  # OTEL_*: off unless it asks for traces
    log.info("event loop: %s", resolve_loop(config.loop))
    log.info("planner: %s", compiled_modules.BUILD)  # mypyc-compiled, or pure Python and why
    try:
        with asyncio.Runner(loop_factory=loop_factory(config.loop)) as runner:
            runner.run(serve(config))
    except (OSError, RuntimeError, KvError) as exc:
        print(f"kvstored: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
