"""A 10-second tour (``python -m kvstore.demo``): start a real ``kvstored`` on
the CPU fallback, then play an engine that caches prompt prefixes through it.

Two "requests" share a system prompt; the second finds the shared prefix
with Lookup, fetches those pages with Get instead of recomputing them, and
Puts only its own new blocks. Ends with the node's stats and a SIGTERM.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from kvstore.launch import NodeProcess
from kvstore.units import format_size, parse_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--page-bytes", default="1MiB", help="bytes per page (one 16-token block)")
    parser.add_argument("--capacity", default="512MiB")
    args = parser.parse_args(argv)
    from kvstore_client import KvClient, chain_keys

    page_bytes, block = parse_size(args.page_bytes), 16
    node = NodeProcess(["--capacity", args.capacity])
    print(f"kvstored ready at {node.address}")
    address = node.address
    try:
        with KvClient(address) as kv:
            print("health:", kv.wait_ready())
            kv.create_namespace("demo-model", page_bytes)
            rng = np.random.default_rng(0)
            system = rng.integers(0, 128_000, 64 * block)  # a 1,024-token shared system prompt
            for user in range(2):
                prompt = np.concatenate([system, rng.integers(0, 128_000, 8 * block)])
                keys = chain_keys(prompt, block)
                # stand-in for the engine's prefill output of every block
                kv_pages = rng.integers(0, 256, (len(keys), page_bytes), dtype=np.uint8)
                start = time.perf_counter()
                cached = kv.lookup("demo-model", keys)
                got = kv.get("demo-model", keys[:cached])
                assert got.found.all()
                fresh = kv_pages[cached:]  # only the uncached blocks are computed and stored
                kv.put("demo-model", keys[cached:], fresh)
                took = (time.perf_counter() - start) * 1e3
                print(f"request {user}: {len(keys)} blocks, {cached} cached ({format_size(cached * page_bytes)} "
                      f"fetched), {len(keys) - cached} computed and stored, {took:.1f} ms")
            # integrity: what comes back is what went in
            check = kv.get("demo-model", keys[cached:])
            assert np.array_equal(check.pages, fresh), "pages changed in the store!"
            stats = kv.stats("demo-model").namespaces[0]
            print(f"stats: {stats.used_slots}/{stats.num_slots} slots, hits {stats.hits}, misses {stats.misses}, "
                  f"puts {stats.puts}")
    finally:
        code = node.terminate()
        print(f"kvstored exited with {code} after SIGTERM")
    return code


if __name__ == "__main__":
    sys.exit(main())
