"""Data pipeline: mmap `.bin/.idx` token files, GPT-2 sample windows, samplers, named corpora.

Import the submodules directly (`from megatron.data.indexed_dataset import ...`).  This file
stays empty on purpose: preprocessing workers are spawned processes that import this package,
and they should not pay for importing torch.
"""
