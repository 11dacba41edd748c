"""The local service stack (`tokenmill stack up | down | env`): local_stack.py, its scripts, simulated hosts."""
