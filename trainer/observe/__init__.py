"""What a run reports: metrics.jsonl, trackers, the profiler window, the phases of a step."""
