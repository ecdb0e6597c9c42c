"""Asynchronous tensor file I/O with plain threads: what DeepSpeed's libaio handle does for
NVMe swapping, driven by the config's top-level `aio` section
(deepspeed/runtime/swap_tensor/aio_config.py).

    io = AsyncTensorIO(AioConfig())
    pending = io.write(tensor, "/nvme/rank0/g0_exp_avg.swp", byte_offset=0)
    ...                                     # compute overlaps the write
    pending.wait()                          # raises the I/O error, if any

How each `aio` key acts:
- block_size: bytes per os.pwrite / os.preadv call; a request is cut into such blocks.
- thread_count (DeepSpeed >= 0.16.4: intra_op_parallelism): threads per direction (one pool
  reads, one writes), so one request's blocks go to disk in parallel.
- queue_depth: blocks each thread may have queued; submitting more waits (bounded memory and
  bounded reordering, like an io_submit queue).
- single_submit: true submits a request's blocks one after another from one thread instead of
  spreading them over the pool.
- overlap_events: false serialises reads against writes (one at a time), true lets them run
  together.

torch ops and os.pread/pwrite release the GIL, so the threads overlap with the optimizer's
compute on the calling thread. Tensors must be contiguous CPU tensors (pinned or not).
"""

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch


class PendingIO:
    """Futures of one request's blocks; wait() returns when all are done (first error raised)."""

    def __init__(self, futures, keep_alive=None):
        self._futures, self._keep_alive = futures, keep_alive

    def wait(self):
        futures, self._futures = self._futures, []
        error = None
        for future in futures:
            try:
                future.result()
            except Exception as e:  # noqa: BLE001 -- wait for every block, then raise the first
                error = error or e
        self._keep_alive = None
        if error is not None:
            raise error


class AsyncTensorIO:
    """Reader and writer thread pools that move tensor bytes to and from files."""

    def __init__(self, aio):
        self.block_size = int(aio.block_size)
        self.single_submit = bool(aio.single_submit)
        threads = max(1, int(aio.thread_count))
        self._pools = {"read": ThreadPoolExecutor(threads, thread_name_prefix="zero-aio-read"),
                       "write": ThreadPoolExecutor(threads, thread_name_prefix="zero-aio-write")}
        self._queue_slots = {d: threading.BoundedSemaphore(threads * max(1, int(aio.queue_depth)))
                             for d in self._pools}
        self._serial = None if aio.overlap_events else threading.Lock()
        self._fds, self._fds_lock = {}, threading.Lock()

    # ----- requests -----

    def write(self, tensor, path, byte_offset=0):
        return self._submit("write", tensor, path, byte_offset)

    def read(self, tensor, path, byte_offset=0):
        return self._submit("read", tensor, path, byte_offset)

    def _submit(self, direction, tensor, path, byte_offset):
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("AsyncTensorIO moves contiguous CPU tensors only")
        view = memoryview(tensor.view(-1).view(torch.uint8).numpy())
        fd = self._fd(path)
        pieces = [(start, min(len(view), start + self.block_size))
                  for start in range(0, len(view), self.block_size)]
        if self.single_submit:
            pieces = [(0, len(view))]
        futures = []
        for start, end in pieces:
            self._queue_slots[direction].acquire()  # waits while the queue is full
            futures.append(self._pools[direction].submit(
                self._run, direction, fd, view[start:end], byte_offset + start))
        return PendingIO(futures, keep_alive=tensor)

    def _run(self, direction, fd, view, offset):
        try:
            if self._serial is not None:
                with self._serial:
                    self._transfer(direction, fd, view, offset)
            else:
                self._transfer(direction, fd, view, offset)
        finally:
            self._queue_slots[direction].release()

    def _transfer(self, direction, fd, view, offset):
        for start in range(0, len(view), self.block_size):
            block = view[start:start + self.block_size]
            done = 0
            while done < len(block):
                if direction == "write":
                    n = os.pwrite(fd, block[done:], offset + start + done)
                else:
                    n = os.preadv(fd, [block[done:]], offset + start + done)
                    if n == 0:  # past the end of a sparse (fast_init) file: zeros
                        block[done:] = bytes(len(block) - done)
                        break
                done += n

    # ----- files -----

    def _fd(self, path):
        with self._fds_lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
                self._fds[path] = fd
            return fd

    def flush(self, path):
        """fsync one file (checkpoint-grade durability is not needed for swap files)."""
        os.fsync(self._fd(path))

    def close(self):
        for pool in self._pools.values():
            pool.shutdown(wait=True)
        with self._fds_lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds = {}
