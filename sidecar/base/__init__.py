"""The ground layer: facts and helpers that know nothing of leases (time, errors and exit
codes, names, secrets in logs, DSN syntax, JSON logs, call statistics). Every other
layer may import it; it imports nothing else from ``sidecar``."""
