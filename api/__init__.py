"""The HTTP service and the ``pipesched`` command line."""
