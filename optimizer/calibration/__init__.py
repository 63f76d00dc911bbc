"""Calibration: a published (or measured) run predicted by the planner's own evaluation, the fit of the
accelerator profiles to many runs, and the held-out error behind each plan's prediction interval.

The rows and their format live with the cost model (:mod:`pipesched.optimizer.cost.calibration`); this package
sits above the planner because a row is predicted exactly as a plan of its layout is.
"""
