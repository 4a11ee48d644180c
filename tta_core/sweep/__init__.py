"""`tta sweep`: grids of `tta bench` runs on Ray, cached per cell, aggregated with
confidence intervals and paired tests (spec.py, run.py, aggregate.py, report.py)."""
