"""Data for the benchmark: synthetic traffic signs, corruptions, shift streams, loaders."""
