"""The real servers tests and benchmarks run against (built or installed on demand)."""
