"""The plan: the hardware, the ladder of rungs, the cost model, and the job resolved for the
ranks."""
