"""Evaluation: the benchmark over a shift stream, reports and plots, the predictor experiment."""
