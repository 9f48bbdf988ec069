"""The asyncio client gives the same results as the blocking one."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.conftest import keys_for, random_pages
from kvstore_client import AsyncKvClient, InvalidArgument, NotFound, Unavailable


@pytest.mark.parametrize("path", ["tcp", "grpc", "shm"])
def test_async_round_trip(node, path: str) -> None:  # type: ignore[no-untyped-def]
    srv, _ = node
    no_shm = path == "shm" and not srv.node.shares_memory  # a staged (GPU-like) pool has no host segment

    async def scenario() -> None:
        async with AsyncKvClient(srv.address, data_path=path, **srv.client_auth) as kv:
            assert await kv.wait_ready() == "SERVING"
            await kv.create_namespace("a", 4096)
            pages = random_pages(20, 4096)
            if no_shm:  # asked for explicitly, it is refused with a clear error, not a silent fallback
                with pytest.raises(Unavailable, match="shared-memory"):
                    await kv.put("a", keys_for(20), pages)
                return
            res = await kv.put("a", keys_for(20), pages)
            assert res.stored == 20
            assert (kv._shm is not None) == (path == "shm")  # the pages went the path asked for (auto: tcp)
            # concurrent gets share one data connection without mixing frames
            results = await asyncio.gather(*(kv.get("a", keys_for(20)[i::4]) for i in range(4)))
            for i, got in enumerate(results):
                assert got.found.all() and np.array_equal(got.pages, pages[i::4])
            assert await kv.lookup("a", keys_for(20) + [b"x"]) == 20
            assert await kv.exists("a", [b"x", keys_for(1)[0]]) == [False, True]
            lease = await kv.pin("a", keys_for(2), ttl=5)
            assert (await kv.stats("a")).namespaces[0].pinned_slots == 2
            assert await kv.unpin("a", lease) == 2
            assert (await kv.delete("a", keys_for(1))).deleted == 1
            # rows received in runs (found_views): misses at the start, in the middle and at the end
            ks = keys_for(6)
            got = await kv.get("a", [ks[0], ks[1], ks[2], b"x", ks[4], ks[5], b"y"])
            assert got.found.tolist() == [False, True, True, False, True, True, False]
            assert np.array_equal(got.pages[[1, 2, 4, 5]], pages[[1, 2, 4, 5]])
            with pytest.raises(InvalidArgument):
                await kv.put("a", [b"k"], random_pages(1, 100))
            with pytest.raises(NotFound):
                await kv.lookup("zz", [b"k"])

    asyncio.run(asyncio.wait_for(scenario(), 30))
