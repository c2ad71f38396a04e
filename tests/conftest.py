"""Shared test fixtures: every suite talks to real servers on loopback (port 0)."""
