"""One router per resource: schedules, jobs, methods, health (with metrics)."""
