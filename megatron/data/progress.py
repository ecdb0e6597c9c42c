"""Progress of a long preprocessing run: a tqdm bar on a terminal when tqdm is installed,
else (a log file, a batch job) plain lines every --log-interval documents."""

import time


class Progress:
    """Counts documents and input bytes; shows docs/s and MB/s.

    Plain lines come each time another `log_interval` documents are done (Megatron's
    `--log-interval`); on a terminal tqdm redraws its bar at its own pace instead.
    """

    def __init__(self, total_bytes, log_interval, stream):
        self._total_bytes = total_bytes
        self._log_interval = max(1, log_interval)
        self._stream = stream
        self._start = time.monotonic()
        self.documents = 0
        self.bytes = 0
        self._bar = self._make_bar()

    def _make_bar(self):
        if not getattr(self._stream, "isatty", lambda: False)():
            return None  # a bar's redraws are noise in a log file
        try:
            from tqdm import tqdm
        except ImportError:
            return None
        return tqdm(total=self._total_bytes, unit="B", unit_scale=True, file=self._stream,
                    desc="tokenizing", mininterval=0.5)

    def update(self, documents, nbytes):
        before = self.documents // self._log_interval
        self.documents += documents
        self.bytes += nbytes
        if self._bar is not None:
            self._bar.set_postfix_str(f"{self.documents} docs, {self._docs_per_s():.0f} docs/s",
                                      refresh=False)
            self._bar.update(nbytes)
        elif self.documents // self._log_interval > before:
            self._print_line()

    def _elapsed(self):
        return max(time.monotonic() - self._start, 1e-9)

    def _docs_per_s(self):
        return self.documents / self._elapsed()

    def _print_line(self):
        mb_per_s = self.bytes / 1e6 / self._elapsed()
        percent = 100.0 * self.bytes / self._total_bytes if self._total_bytes else 100.0
        print(f"processed {self.documents} documents ({self._docs_per_s():.1f} docs/s, "
              f"{mb_per_s:.2f} MB/s, {percent:.1f}% of input)", file=self._stream, flush=True)

    def close(self):
        if self._bar is not None:
            self._bar.close()
