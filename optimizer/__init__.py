"""The problem and schedule model, the simulator, the schedule families and the search (no torch, ever)."""
