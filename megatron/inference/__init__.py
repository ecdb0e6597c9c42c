"""Inference from any checkpoint format: building the model (`loading.py`), sampling with a
KV cache (`text_generation.py`), zero-shot evaluation (`zeroshot.py`)."""
