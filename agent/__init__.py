"""The node agent: what runs on each machine that offers compute. It registers the node, heartbeats,
stages a job's data into its cache, builds its environment, starts it in a sandbox, reads its
output, metrics and checkpoints, stops it, returns its outputs and releases the compute
(`manage.py runner`). Above the scheduler in the layers: it runs the allocations the scheduler made.

- runner.py: the loop (launch, stage, heartbeat, release); running.py: one job's process until it ends
- isolation.py and jobshim.py: the sandbox (bubblewrap, cgroups, a uid of its own)
- staging.py and cache.py: data into the node's cache; environments.py: a job's Python packages
- checkpoints.py, jobfiles.py, logcap.py, sampling.py, smoke.py, stopping.py: what a run leaves and
  how it is watched
"""
