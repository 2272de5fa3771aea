"""vllite."""
