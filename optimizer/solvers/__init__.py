"""Search backends for ``solver.method: "auto"``."""
