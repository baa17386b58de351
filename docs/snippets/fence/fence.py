"""Fenced writes next to lease-sidecar: the database refuses a stale leader's token.

Needs the guard (lease-sidecar fence-schema --apply), psycopg 3 and the sidecar package
for sidecar.client (standard library only).
"""

import os
import sys

import psycopg

from sidecar.client import Leadership, NotLeader, StaleToken, psycopg_transaction

leadership = Leadership("leader", url=os.environ.get("LEASE_LEADER_URL",
                                                     "http://127.0.0.1:8099/leader"))
with psycopg.connect(os.environ["DATABASE_URL"]) as conn:
    try:
        # Checks the claim (rule 1), opens the transaction, runs the guard (rule 2).
        with psycopg_transaction(conn, leadership) as claim:
            conn.execute("INSERT INTO writes (token) VALUES (%s)", (claim.fencing_token,))
        print(f"wrote token={claim.fencing_token}")
    except StaleToken as refused:
        print(f"refused token={refused.token} sqlstate=LF001")
        sys.exit(3)
    except NotLeader:
        print("not leader")
        sys.exit(4)
