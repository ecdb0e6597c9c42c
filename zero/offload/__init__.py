"""ZeRO-Offload / ZeRO-Infinity: optimizer state on the host or in NVMe swap files
(`host_masters.py`, over the stores of `state_store.py`), stage 3 parameter shards in swap
files (`param_swapper.py`), the asynchronous file I/O both use (`aio.py`) and the swap folder
(`swap_dir.py`)."""
