"""sentinels package (in progress)."""
