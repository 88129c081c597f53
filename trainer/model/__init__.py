"""What trains: the HF model built or loaded per rank, and the fine-tune methods on it."""
