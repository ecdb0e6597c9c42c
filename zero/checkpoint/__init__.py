"""Engine checkpoints in DeepSpeed's layout: saving and loading (`layout.py`), the stage 0-2
optimizer state between the engine's partitioning and DeepSpeed's (`partitions.py`), stage 3's
files (`stage3.py`), and the standalone `zero_to_fp32.py` copied next to every save."""
