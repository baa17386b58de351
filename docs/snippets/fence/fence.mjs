// Fenced writes next to lease-sidecar: the database refuses a stale leader's token.
// Node.js 18+ and the pg package (npm install pg).
import pg from "pg";

const url = process.env.LEASE_LEADER_URL ?? "http://127.0.0.1:8099/leader";

// One unit of work in one transaction, guarded by the token: the guard comes first,
// and refuses (SQLSTATE LF001) once a newer leader has written.
async function fencedWrite(client, claim) {
  await client.query("BEGIN");
  try {
    await client.query("SELECT lease.lease_fence($1, $2)", [claim.lease, claim.fencing_token]);
    await client.query("INSERT INTO writes (token) VALUES ($1)", [claim.fencing_token]);
    await client.query("COMMIT");
  } catch (err) {
    await client.query("ROLLBACK");
    throw err;
  }
}

const claim = await (await fetch(url)).json(); // 503 carries the same JSON
if (!claim.leader || Date.now() >= claim.valid_until_ms) {
  console.log("not leader");
  process.exit(4);
}
const client = new pg.Client({ connectionString: process.env.DATABASE_URL });
await client.connect();
try {
  await fencedWrite(client, claim);
  console.log(`wrote token=${claim.fencing_token}`);
} catch (err) {
  if (err.code !== "LF001") throw err;
  console.log(`refused token=${claim.fencing_token} sqlstate=${err.code}`);
  process.exitCode = 3;
} finally {
  await client.end();
}
