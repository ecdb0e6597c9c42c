"""Megatron-layout checkpoints (`megatron_layout.py`) and `--keep-last-n-checkpoints`
(`retention.py`)."""
