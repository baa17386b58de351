#!/usr/bin/env bash
# Singleton work next to lease-sidecar: only while this pod leads, token downstream.
# Needs bash 5 (or busybox sh) for EPOCHREALTIME, and curl.
url="${LEASE_LEADER_URL:-http://127.0.0.1:8099/leader}"
body=$(mktemp) headers=$(mktemp)
trap 'rm -f "$body" "$headers"' EXIT
etag="" leading=""

work() {  # token now_ms until_ms: one short unit; pass the token with every write
  echo "work token=$1 now_ms=$2 until_ms=$3"
  sleep 0.1
}

while true; do
  # Standby: block in the sidecar until the answer changes. Leading: ask again
  # before each unit, since one claim lasts only until its valid_until.
  if [ -n "$leading" ]; then wait=0; else wait=30; fi
  : >"$body"; : >"$headers"
  code=$(curl -s -m $((wait + 5)) -o "$body" -D "$headers" -w '%{http_code}' \
    ${etag:+-H "If-None-Match: $etag"} "$url?wait=$wait") || { code=000; sleep 1; }
  etag=$(sed -n 's/^[Ee][Tt][Aa][Gg]: *\(.*\)\r$/\1/p' "$headers")
  token=$(sed -n 's/.*"fencing_token": \([0-9]*\).*/\1/p' "$body")
  until_ms=$(sed -n 's/.*"valid_until_ms": \([0-9]*\).*/\1/p' "$body")
  now=$EPOCHREALTIME
  frac=${now#*.}
  now_ms=${now%.*}${frac:0:3}
  if [ "$code" = 200 ] && [ -n "$until_ms" ] && [ "$now_ms" -lt "$until_ms" ]; then
    work "$token" "$now_ms" "$until_ms"
  elif [ -n "$leading" ] && [ "$code" != 200 ]; then
    echo standby
  fi
  # A "yes" that arrived too late to use (past valid_until_ms) is no work, but
  # still a reason to ask again at once rather than long-poll.
  if [ "$code" = 200 ]; then leading=1; else leading=""; fi
done
