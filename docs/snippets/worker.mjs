// Singleton work next to lease-sidecar: only while this pod leads, token downstream.
const url = process.env.LEASE_LEADER_URL ?? "http://127.0.0.1:8099/leader";
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// One short unit of work. Send the token with every write; the store refuses a token
// smaller than the largest it has seen (a paused ex-leader).
async function work(token, nowMs, untilMs) {
  console.log(`work token=${token} now_ms=${nowMs} until_ms=${untilMs}`);
  await sleep(100);
}

let etag = null;
let leading = false;
for (;;) {
  // Standby: block in the sidecar until the answer changes. Leading: ask again
  // before each unit, since one claim lasts only until its valid_until.
  const wait = leading ? 0 : 30;
  let claim = { leader: false };
  try {
    const response = await fetch(`${url}?wait=${wait}`, {
      headers: etag ? { "If-None-Match": etag } : {},
      signal: AbortSignal.timeout((wait + 5) * 1000),
    });
    etag = response.headers.get("ETag");
    claim = await response.json();
  } catch {
    etag = null; // no sidecar: not leader
    await sleep(1000);
  }
  const now = Date.now();
  if (claim.leader && now < claim.valid_until_ms) {
    await work(claim.fencing_token, now, claim.valid_until_ms);
  } else if (leading && !claim.leader) {
    console.log("standby");
  }
  // A "yes" that arrived too late to use (past valid_until_ms) is no work, but
  // still a reason to ask again at once rather than long-poll.
  leading = claim.leader;
}
