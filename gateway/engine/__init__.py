"""The engines: one step loop per executor (loop.py) on its state (state.py), run on their own
event loop and thread (host.py); batches in flight, side calls, recovery and orphans; the
router that picks an engine."""
