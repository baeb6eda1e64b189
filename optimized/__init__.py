"""optimized package (in progress)."""
