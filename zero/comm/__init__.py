"""Collectives over one process group with byte accounting (`communicator.py`), and the
point-to-point versions used where gloo has no fast one (`ring.py`)."""
