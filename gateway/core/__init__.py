"""The scheduling core, plain Python: requests and sequences, the scheduler, and what a step
sends and receives."""
