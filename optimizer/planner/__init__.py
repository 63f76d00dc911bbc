"""The planner: model + cluster + global batch → ranked parallel configurations and their schedules."""
