"""oomless training engine: one loop, pluggable backends (docs/architecture.md)."""
