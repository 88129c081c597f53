"""oomless training engine: one loop, pluggable backends (see DESIGN.md)."""
