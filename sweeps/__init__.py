"""Sweeps: a search over a job's hyperparameters or config keys, whose trials are jobs, capped by
money for the whole search (issue 23; see docs/user-guide.md)."""
