"""What the user reads: `oomless estimate` and `plan` output, a run's report and memory timeline."""
