"""``found_views``, the rows a read of a batch fills (kvstore_client._common): pure, no sockets."""

from __future__ import annotations

import numpy as np

from kvstore_client._common import found_views


def test_found_views_are_runs_of_found_rows() -> None:
    out = np.arange(8 * 4, dtype=np.uint8).reshape(8, 4)
    views = found_views(out, np.array([0, 1, 1, 0, 1, 0, 1, 1], dtype=bool))
    assert [bytes(v) for v in views] == [out[1:3].tobytes(), out[4].tobytes(), out[6:8].tobytes()]
    views[0][:] = b"\xff" * 8              # the views are the rows themselves: what a read fills lands in out
    assert (out[1:3] == 255).all() and (out[0] == [0, 1, 2, 3]).all()
    assert found_views(out, np.zeros(8, dtype=bool)) == []
    assert len(found_views(out, np.ones(8, dtype=bool))) == 1
