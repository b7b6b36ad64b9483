"""Executors: where an allocation's compute comes from (issue 26).

base.py is the seam the scheduler needs from compute, as plain data; slurm.py runs allocations as
jobs of an existing Slurm cluster. Neither imports Django (the import contract in pyproject.toml);
configured.py builds the operator's executor from the settings.
"""
