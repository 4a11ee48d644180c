"""Models: the zoo, unit decomposition, per-unit statistics, the source model and its card."""
