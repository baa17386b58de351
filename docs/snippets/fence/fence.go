// Fenced writes next to lease-sidecar: the database refuses a stale leader's token.
// Needs the guard (lease-sidecar fence-schema --apply) and the pgx driver.
package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	_ "github.com/jackc/pgx/v5/stdlib"
)

type claim struct {
	Leader       bool   `json:"leader"`
	Lease        string `json:"lease"`
	FencingToken int64  `json:"fencing_token"`
	ValidUntilMs int64  `json:"valid_until_ms"`
}

// fencedWrite runs one unit of work in one transaction, guarded by the token: the
// guard comes first, and refuses (SQLSTATE LF001) once a newer leader has written.
func fencedWrite(ctx context.Context, db *sql.DB, c claim) error {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	if _, err := tx.ExecContext(ctx, "SELECT lease.lease_fence($1, $2)", c.Lease, c.FencingToken); err != nil {
		return err
	}
	if _, err := tx.ExecContext(ctx, "INSERT INTO writes (token) VALUES ($1)", c.FencingToken); err != nil {
		return err
	}
	return tx.Commit()
}

func main() {
	url := os.Getenv("LEASE_LEADER_URL")
	if url == "" {
		url = "http://127.0.0.1:8099/leader"
	}
	var c claim
	if resp, err := http.Get(url); err == nil { // 503 carries the same JSON
		json.NewDecoder(resp.Body).Decode(&c)
		resp.Body.Close()
	}
	if !c.Leader || time.Now().UnixMilli() >= c.ValidUntilMs {
		fmt.Println("not leader")
		os.Exit(4)
	}
	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer db.Close()
	err = fencedWrite(context.Background(), db, c)
	var pgErr *pgconn.PgError
	switch {
	case err == nil:
		fmt.Printf("wrote token=%d\n", c.FencingToken)
	case errors.As(err, &pgErr) && pgErr.Code == "LF001":
		fmt.Printf("refused token=%d sqlstate=%s\n", c.FencingToken, pgErr.Code)
		os.Exit(3)
	default:
		panic(err)
	}
}
