"""Tools around the three services, outside them: the local launcher (`python -m tools.launch`,
what `make run` starts), the command-line client (`python -m tools.client`) and the health
probe the container healthchecks run (`python -m tools.health_probe`)."""
