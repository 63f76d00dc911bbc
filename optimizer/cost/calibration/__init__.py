"""Calibration of the cost model: published training runs (``data/``), the fit of the accelerator profiles to
them, and the held-out error that becomes each plan's prediction interval. ``README.md`` documents the format."""
