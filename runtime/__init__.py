"""Execute a schedule with torch.distributed and verify it (needs the ``runtime`` extra: torch)."""
