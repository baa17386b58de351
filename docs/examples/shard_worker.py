"""Work on the partitions whose shards this pod leads, next to lease-sidecar.

Shard ``orders-7`` is partition 7 of the work (orders whose id hashes to 7, say). Each
round asks ``GET /shards`` for the shards led *now*, works on each one's partition while
its claim lasts, and passes the shard's fencing token downstream; with no shard it
long-polls until one comes. Python 3.9+, standard library only.
"""

import json
import os
import time
import urllib.request

SIDECAR = os.environ.get("LEASE_SIDECAR_URL", "http://127.0.0.1:8099")


def now_ms():
    return time.time_ns() // 1_000_000


def shards(etag=None, wait=0):
    """This pod's shards: (the document, its ETag). With ``wait`` and the ETag of the
    last answer, returns when the shards led change, or after ``wait`` seconds."""
    url = f"{SIDECAR}/shards" + (f"?wait={wait}" if wait else "")
    headers = {"If-None-Match": etag} if etag else {}
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=wait + 5) as answer:
        return json.load(answer), answer.headers["ETag"]


def work_on(partition, token, until_ms):
    """One short unit of the partition's work. Send ``token`` with every write and let
    the store refuse a token smaller than the largest it has seen for the partition
    (see docs/fencing.md): a unit still running when the shard has moved is stopped
    there."""
    print(f"work shard={partition} token={token} now_ms={now_ms()} until_ms={until_ms}",
          flush=True)
    time.sleep(0.02)


def main():
    etag = None
    while True:
        try:
            body, etag = shards()
            if not body["shards"]:
                body, etag = shards(etag, wait=30)  # park until a shard comes
                continue
            for shard in body["shards"]:
                # A claim lasts one claim horizon: start a unit only before it ends,
                # then ask again for the next round.
                if now_ms() < shard["valid_until_ms"]:
                    work_on(shard["shard"], shard["fencing_token"], shard["valid_until_ms"])
        except (OSError, ValueError):
            time.sleep(1)  # the sidecar is not answering: no shard is ours


if __name__ == "__main__":
    main()
