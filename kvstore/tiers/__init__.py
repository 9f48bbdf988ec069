"""Storage below a node's pool. Today: :mod:`kvstore.tiers.slab`, the disk tier's record format (slab files
of checksummed page slots that a restarted node can scan back). The tier stack that demotes the pool's
evictions into it and serves them back is not wired into the node yet."""
