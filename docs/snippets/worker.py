"""Singleton work next to lease-sidecar: only while this pod leads, token downstream."""

import json
import os
import time
import urllib.error
import urllib.request

URL = os.environ.get("LEASE_LEADER_URL", "http://127.0.0.1:8099/leader")


def work(token: int, now_ms: int, until_ms: int) -> None:
    # One short unit of work. Send the token with every write; the store refuses a
    # token smaller than the largest it has seen (a paused ex-leader).
    print(f"work token={token} now_ms={now_ms} until_ms={until_ms}", flush=True)
    time.sleep(0.1)


def main() -> None:
    etag, leading = None, False
    while True:
        # Standby: block in the sidecar until the answer changes. Leading: ask again
        # before each unit, since one claim lasts only until its valid_until.
        wait = 0 if leading else 30
        request = urllib.request.Request(f"{URL}?wait={wait}",
                                         headers={"If-None-Match": etag} if etag else {})
        try:
            with urllib.request.urlopen(request, timeout=wait + 5) as response:
                claim, etag = json.load(response), response.headers["ETag"]
        except urllib.error.HTTPError as err:  # 503: not leader
            claim, etag = json.load(err), err.headers["ETag"]
        except OSError:  # no sidecar: not leader either
            claim, etag = {"leader": False}, None
            time.sleep(1)
        now_ms = time.time_ns() // 1_000_000
        if claim["leader"] and now_ms < claim["valid_until_ms"]:
            work(claim["fencing_token"], now_ms, claim["valid_until_ms"])
        elif leading and not claim["leader"]:
            print("standby", flush=True)
        # A "yes" that arrived too late to use (past valid_until_ms) is no work, but
        # still a reason to ask again at once rather than long-poll.
        leading = claim["leader"]


if __name__ == "__main__":
    main()
