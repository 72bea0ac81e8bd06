"""Policies: YAML config models and pure planners (retention, drills, cadence math)."""
