"""The wing for parallelism: the dimensions' process groups (`mesh`), the one order in which a
model is changed (`parallelize`), the sequence, tensor and expert splits (`sequence`, `tensor`,
`expert`) and the rank's share of the batch (`split`). docs/adding-a-rung.md says how a
dimension is added."""
