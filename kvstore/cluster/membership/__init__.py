"""Who is alive and who coordinates, behind one interface (``MembershipView``).

``gossip`` is the default backend (heartbeats between peers; the interface
and the heartbeat round, ``plan_round``, live there too); ``etcd_view`` and
``etcd`` are the etcd backend (leases and an elected coordinator: the pure
view, then its I/O shell, imported only for ``--membership etcd://...``, as
its client is an optional dependency); ``backend`` picks one from
``--membership``.
"""

from kvstore.cluster.membership.backend import make_membership
from kvstore.cluster.membership.gossip import Change, Member, Membership, MembershipView, Round, plan_round

__all__ = ["Change", "Member", "Membership", "MembershipView", "Round", "make_membership", "plan_round"]
