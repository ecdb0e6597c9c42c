"""Megatron-style GPT-2 pretraining: tensor-parallel model (mpu), data pipeline, trainer."""

__version__ = "0.1.0"
