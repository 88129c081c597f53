"""The processes: the process group, stop signals, Slurm requeue, out-of-memory detection."""
