// Singleton work next to lease-sidecar: only while this pod leads, token downstream.
package main

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"time"
)

type claim struct {
	Leader       bool  `json:"leader"`
	FencingToken int64 `json:"fencing_token"`
	ValidUntilMs int64 `json:"valid_until_ms"`
}

// work does one short unit. Send the token with every write; the store refuses a
// token smaller than the largest it has seen (a paused ex-leader).
func work(token, nowMs, untilMs int64) {
	fmt.Printf("work token=%d now_ms=%d until_ms=%d\n", token, nowMs, untilMs)
	time.Sleep(100 * time.Millisecond)
}

func main() {
	url := os.Getenv("LEASE_LEADER_URL")
	if url == "" {
		url = "http://127.0.0.1:8099/leader"
	}
	etag, leading := "", false
	for {
		// Standby: block in the sidecar until the answer changes. Leading: ask again
		// before each unit, since one claim lasts only until its valid_until.
		wait := 30
		if leading {
			wait = 0
		}
		var c claim
		req, _ := http.NewRequest("GET", fmt.Sprintf("%s?wait=%d", url, wait), nil)
		if etag != "" {
			req.Header.Set("If-None-Match", etag)
		}
		client := http.Client{Timeout: time.Duration(wait+5) * time.Second}
		if resp, err := client.Do(req); err != nil { // no sidecar: not leader
			etag = ""
			time.Sleep(time.Second)
		} else {
			etag = resp.Header.Get("ETag")
			if json.NewDecoder(resp.Body).Decode(&c) != nil {
				c = claim{}
			}
			resp.Body.Close()
		}
		now := time.Now().UnixMilli()
		if c.Leader && now < c.ValidUntilMs {
			work(c.FencingToken, now, c.ValidUntilMs)
		} else if leading && !c.Leader {
			fmt.Println("standby")
		}
		// A "yes" that arrived too late to use (past valid_until_ms) is no work, but
		// still a reason to ask again at once rather than long-poll.
		leading = c.Leader
	}
}
