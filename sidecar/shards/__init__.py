"""Shard sets (``LEASE_SHARDS``): many leases spread over a group's members.

- :mod:`.assign`: which member should hold which shard, a pure function of the shard
  names and the live members;
- :mod:`.manager`: which shards this member campaigns for, and how shards move.

Each shard is an ordinary lease under an ordinary elector; the members' records and the
shards' shared renewals live in the backend (:class:`sidecar.lease.ShardGroup`); what the
application sees is published by :mod:`sidecar.publish.shards`. docs/sharding.md says
how to use it.
"""
