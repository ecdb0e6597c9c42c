"""The ZeRO stages: stage 0-2 over flat buffers (`stage1_2.py`), stage 3 over partitioned
parameters (`partition_parameters.py`, `param_coordinator.py`, `stage3.py`), the step rules
they share (`partitioned_optimizer.py`), and `build.py`, which picks one for a config."""
