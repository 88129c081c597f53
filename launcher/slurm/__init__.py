"""`oomless submit`: the partition's nodes, the sbatch script and its template."""
