"""Model implementations written for the engine (paged attention, flattened tokens)."""
