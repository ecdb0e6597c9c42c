"""Pipeline parallelism: the transformer's layers split over stages (megatron/model), the
activations and their gradients passed between stages (`p2p.py`), the tied word embeddings
of the first and last stage (`tied_embeddings.py`) and the schedules that order the
micro batches' forward and backward passes (`schedules.py`)."""
