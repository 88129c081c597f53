"""Checkpoints: written sharded and atomic, verified by their manifest, exported as HF models."""
