"""The chaos harness: sidecars under injected faults, every claim recorded and checked."""
