"""Collectives over one process group with byte accounting (`communicator.py`), the
point-to-point versions used where gloo has no fast one (`ring.py`), and the device and
failure flag that every layer's collectives share (`agreement.py`)."""
