"""DeepSpeed JSON configs: the strict parser (`parsing.py`), the typed sections
(`sections.py`), the config object with the batch-size rule (`deepspeed_config.py`), and
DeepSpeed's command-line flags (`arguments.py`)."""
