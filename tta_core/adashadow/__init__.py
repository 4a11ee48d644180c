"""AdaShadow: the assessor, the latency cost model (profile, predictor, expansion,
calibration, feedback loops), the planner, the planning service and the engine."""
