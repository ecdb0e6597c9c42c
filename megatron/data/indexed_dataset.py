"""Megatron's mmap indexed dataset: token arrays in `<prefix>.bin`, their layout in `<prefix>.idx`.

Byte compatible with Megatron-LM / fairseq `MMapIndexedDataset` (and megatron-core's
`IndexedDataset`).  The `.idx` file is, in order (little endian):

    magic      9 bytes  b"MMIDIDX\\x00\\x00"
    version    <Q       1
    dtype      <B       code of the token dtype (DTYPES below)
    num_items  <Q       len(sizes)
    num_docs   <Q       len(doc_idx)
    sizes      int32[num_items]   tokens per item
    pointers   int64[num_items]   byte offset of each item in .bin (exclusive cumsum of sizes)
    doc_idx    int64[num_docs]    item index where each document starts, plus the end: [0, ..., n]

`.bin` is the items' tokens back to back, no header.  GPT-2 preprocessing writes one item per
document, so items and documents coincide there.
"""

import glob
import os
import struct
from array import array

import numpy as np

from megatron.errors import DataError

_MAGIC = b"MMIDIDX\x00\x00"
_LEGACY_MAGIC = b"TNTIDX\x00\x00"  # the fairseq/Megatron "lazy"/"cached" format
_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, num_items, num_docs

# Codes 1-6 and 8 are what every Megatron reader agrees on.  Old Megatron mapped 7 to
# np.double (a second float64 that its writer never emitted); megatron-core reads 7 as float32,
# so we follow megatron-core and write float64 as 6.
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
          6: np.float64, 7: np.float32, 8: np.uint16}

BUILD_HINT = ("build it with: python tools/preprocess_data.py --input <corpus.json> "
              "--output-prefix <prefix> --tokenizer-type GPT2BPETokenizer "
              "--vocab-file <vocab.json> --merge-file <merges.txt> --append-eod  (the prefix "
              "then ends in _text_document)")


def data_file_path(prefix):
    return prefix + ".bin"


def index_file_path(prefix):
    return prefix + ".idx"


def dataset_exists(prefix):
    return os.path.exists(index_file_path(prefix)) and os.path.exists(data_file_path(prefix))


def best_dtype(vocab_size):
    """The smallest dtype Megatron uses for token ids of this vocabulary."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def dtype_code(dtype):
    dtype = np.dtype(dtype)
    for code, candidate in DTYPES.items():
        if np.dtype(candidate) == dtype:
            return code
    raise ValueError(f"dtype {dtype} has no MMIDIDX code; use one of "
                     f"{sorted(np.dtype(d).name for d in DTYPES.values())}")


def _temp_path(path):
    return f"{path}.tmp.{os.getpid()}"


class _Index:
    """The parsed `.idx` file; arrays are read-only views of an np.memmap."""

    def __init__(self, path):
        self.path = path
        file_size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
        self._check_magic(head)
        if len(head) < _HEADER.size:
            raise DataError(f"{path} is truncated: {file_size} bytes, shorter than the "
                            f"{_HEADER.size}-byte MMIDIDX header; rebuild it ({BUILD_HINT})")
        _, version, code, num_items, num_docs = _HEADER.unpack(head)
        if version != _VERSION:
            raise DataError(f"{path} is MMIDIDX version {version}; only version {_VERSION} "
                            f"is supported. Rebuild it ({BUILD_HINT})")
        if code not in DTYPES:
            raise DataError(f"{path} names unknown dtype code {code} (known: "
                            f"{sorted(DTYPES)}); the file is corrupt. Rebuild it ({BUILD_HINT})")
        self.dtype = np.dtype(DTYPES[code])
        expected = _HEADER.size + num_items * (4 + 8) + num_docs * 8
        if file_size < expected:
            raise DataError(f"{path} is truncated: its header promises {num_items} items and "
                            f"{num_docs} document boundaries ({expected} bytes) but the file has "
                            f"{file_size} bytes. Rebuild it ({BUILD_HINT})")
        buffer = np.memmap(path, mode="r", dtype=np.uint8)
        offset = _HEADER.size
        self.sizes = np.frombuffer(buffer, np.int32, count=num_items, offset=offset)
        offset += self.sizes.nbytes
        self.pointers = np.frombuffer(buffer, np.int64, count=num_items, offset=offset)
        offset += self.pointers.nbytes
        self.doc_idx = np.frombuffer(buffer, np.int64, count=num_docs, offset=offset)
        self._check_items()
        self._check_document_index(num_items)

    def _corrupt(self, what):
        return DataError(f"{self.path}: {what}; the file is corrupt. Rebuild it ({BUILD_HINT})")

    def _check_items(self, chunk=1 << 22):
        """Sizes are non-negative and the items lie back to back from byte 0 of the .bin:
        pointer[i] = the bytes of items 0..i-1. (So no two items overlap and the last one
        ends where the .bin must end, which MMapIndexedDataset checks against its size.)
        Vectorised, in chunks of items so memory stays bounded on large corpora."""
        itemsize, expected = self.dtype.itemsize, 0
        for lo in range(0, len(self.sizes), chunk):
            sizes = self.sizes[lo:lo + chunk].astype(np.int64)
            pointers = self.pointers[lo:lo + chunk]
            negative = np.flatnonzero(sizes < 0)
            if len(negative):
                i = lo + int(negative[0])
                raise self._corrupt(f"item {i} has a negative size ({int(self.sizes[i])})")
            starts = expected + np.concatenate(([0], np.cumsum(sizes[:-1] * itemsize)))
            wrong = np.flatnonzero(pointers != starts)
            if len(wrong):
                i = lo + int(wrong[0])
                raise self._corrupt(f"item {i} starts at byte {int(self.pointers[i])} of the "
                                    f".bin, but the items before it end at byte "
                                    f"{int(starts[wrong[0]])} (items must lie back to back)")
            expected = int(starts[-1]) + int(sizes[-1]) * itemsize

    def _check_document_index(self, num_items):
        """Document boundaries are item numbers from 0 to num_items, never decreasing."""
        doc_idx = self.doc_idx
        if len(doc_idx) == 0:
            raise self._corrupt("the document index is empty (it starts with 0 even for an "
                                "empty dataset)")
        bad = np.flatnonzero((doc_idx < 0) | (doc_idx > num_items))
        if len(bad):
            raise self._corrupt(f"document boundary {int(bad[0])} points at item "
                                f"{int(doc_idx[bad[0]])}, outside its {num_items} items")
        falling = np.flatnonzero(np.diff(doc_idx) < 0)
        if len(falling):
            raise self._corrupt(f"document boundaries go backwards at entry "
                                f"{int(falling[0]) + 1}")
        if doc_idx[0] != 0 or doc_idx[-1] != num_items:
            raise self._corrupt(f"the document index runs from item {int(doc_idx[0])} to "
                                f"{int(doc_idx[-1])}, but must cover items 0 to {num_items} "
                                "(it disagrees with the sizes)")

    def _check_magic(self, head):
        if head.startswith(_LEGACY_MAGIC):
            raise DataError(f"{self.path} is a legacy TNTIDX index (Megatron's 'lazy'/'cached' "
                            f"--dataset-impl), not the mmap MMIDIDX format this project reads. "
                            f"Re-run preprocessing with --dataset-impl mmap ({BUILD_HINT})")
        if len(head) < len(_MAGIC) and _MAGIC.startswith(head):
            raise DataError(f"{self.path} is truncated ({len(head)} bytes, no complete MMIDIDX "
                            f"header); rebuild it ({BUILD_HINT})")
        if not head.startswith(_MAGIC):
            raise DataError(f"{self.path} is not an MMIDIDX index (first bytes {head[:9]!r}, "
                            f"expected {_MAGIC!r}); is it the right file? ({BUILD_HINT})")

    def data_bytes(self):
        """Bytes of .bin that the index describes: where the last item ends."""
        if len(self.sizes) == 0:
            return 0
        return int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize


class DatasetIndexError(DataError, IndexError):
    """An item index or token range past the end; also an IndexError so iteration stops."""


def _missing_dataset_hint(prefix):
    """The likeliest intended prefix next to a missing one: the same without a .bin/.idx
    extension, or preprocess_data.py's `--output-prefix` given without the `_{key}_document`
    it appends; else how to build one."""
    stem, extension = os.path.splitext(prefix)
    if extension in (".bin", ".idx") and dataset_exists(stem):
        return f"drop the {extension} extension: --data-path {stem}"
    candidates = glob.glob(glob.escape(prefix) + "_*_document.idx")
    built = sorted(path[:-len(".idx")] for path in candidates
                   if os.path.exists(path[:-len(".idx")] + ".bin"))
    if built:
        return (f"tools/preprocess_data.py names its outputs --output-prefix + _<json key>"
                f"_document: --data-path {built[0]}")
    return BUILD_HINT


class MMapIndexedDataset:
    """Read-only view of `<prefix>.bin/.idx`; items come back as numpy arrays without copies."""

    def __init__(self, prefix, skip_warmup=True):
        self._prefix = prefix
        self._skip_warmup = skip_warmup
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        for path in (idx_path, bin_path):
            if not os.path.exists(path):
                raise DataError(f"indexed dataset {prefix!r}: {path} does not exist. "
                                f"--data-path takes the prefix without .bin/.idx; "
                                f"{_missing_dataset_hint(prefix)}")
        self._index = _Index(idx_path)
        bin_size = os.path.getsize(bin_path)
        described = self._index.data_bytes()
        if bin_size != described:
            problem = ("is shorter than its index says: the .bin is truncated (an interrupted "
                       "copy or build?)" if bin_size < described else
                       "is longer than its index says: the .bin and .idx are from different builds")
            raise DataError(f"{bin_path} ({bin_size} bytes) {problem}; {idx_path} describes "
                            f"{described} bytes. Rebuild both ({BUILD_HINT})")
        if not skip_warmup:
            _warmup(idx_path)
            _warmup(bin_path)
        # np.memmap refuses empty files; an empty dataset simply has no bytes to view.
        self._bin = memoryview(np.memmap(bin_path, mode="r", dtype=np.uint8)) if bin_size else b""

    # Pickle only the prefix: DataLoader workers reopen the memmap instead of copying the data.
    def __getstate__(self):
        return {"prefix": self._prefix, "skip_warmup": True}

    def __setstate__(self, state):
        self.__init__(state["prefix"], state["skip_warmup"])

    def __len__(self):
        return len(self._index.sizes)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return [self.get(i) for i in range(*idx.indices(len(self)))]
        return self.get(idx)

    def get(self, idx, offset=0, length=None):
        """Tokens [offset, offset+length) of item `idx` (to its end when length is None)."""
        idx = self._check_index(idx)
        size = int(self._index.sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise DatasetIndexError(f"{data_file_path(self._prefix)}: item {idx} has {size} "
                                    f"tokens; cannot read {length} tokens at offset {offset}")
        itemsize = self._index.dtype.itemsize
        start = int(self._index.pointers[idx]) + offset * itemsize
        if start + length * itemsize > len(self._bin):
            raise DatasetIndexError(f"{index_file_path(self._prefix)} points item {idx} past "
                                    f"the end of {data_file_path(self._prefix)}; the files are "
                                    f"corrupt. Rebuild them ({BUILD_HINT})")
        return np.frombuffer(self._bin, dtype=self._index.dtype, count=length, offset=start)

    def _check_index(self, idx):
        n = len(self)
        idx = int(idx)
        if not -n <= idx < n:
            raise DatasetIndexError(f"{self._prefix}: item index {idx} is out of range; "
                                    f"the dataset has {n} items")
        return idx + n if idx < 0 else idx

    @property
    def prefix(self):
        return self._prefix

    @property
    def sizes(self):
        return self._index.sizes

    @property
    def doc_idx(self):
        return self._index.doc_idx

    @property
    def dtype(self):
        return self._index.dtype

    @staticmethod
    def exists(prefix):
        return dataset_exists(prefix)


def _warmup(path, chunk_bytes=100 * 1024 * 1024):
    """Read the file once so its pages are in the OS cache before training starts."""
    with open(path, "rb") as f:
        while f.read(chunk_bytes):
            pass


class MMapIndexedDatasetBuilder:
    """Streams items into `<bin_path>` through a temp file; `finalize` renames both into place.

    Use as a context manager (or call `discard`) so a failure leaves no temp files behind and
    never replaces a complete dataset with a partial one.
    """

    def __init__(self, bin_path, dtype=np.int64):
        self._dtype = np.dtype(dtype)
        dtype_code(self._dtype)  # fail early on a dtype the format cannot name
        self._bin_path = bin_path
        self._tmp_bin_path = _temp_path(bin_path)
        self._bin_file = open(self._tmp_bin_path, "wb")
        self._sizes = array("i")       # int32 per item, compact for millions of documents
        self._doc_idx = array("q", [0])  # int64 item index where each document starts

    def add_item(self, tokens):
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"add_item takes a 1-d token array, got shape {tokens.shape}")
        if tokens.size and not np.can_cast(tokens.dtype, self._dtype, casting="safe"):
            self._check_range(tokens)
        self._bin_file.write(tokens.astype(self._dtype, copy=False).tobytes())
        self._sizes.append(tokens.size)

    def _check_range(self, tokens):
        if self._dtype.kind not in "iu":
            return
        info = np.iinfo(self._dtype)
        low, high = tokens.min(), tokens.max()
        if low < info.min or high > info.max:
            raise DataError(f"token id {high if high > info.max else low} does not fit the "
                            f"{self._dtype} token file {self._bin_path}; the tokenizer's vocab is "
                            f"larger than the dtype chosen for it (see best_dtype)")

    def end_document(self):
        self._doc_idx.append(len(self._sizes))

    def merge_file_(self, other_prefix):
        """Append every item and document of another dataset of the same dtype."""
        other = MMapIndexedDataset(other_prefix)
        if other.dtype != self._dtype:
            raise DataError(f"cannot merge {data_file_path(other_prefix)} ({other.dtype}) into "
                            f"{self._bin_path} ({self._dtype}); build both with one tokenizer")
        offset = len(self._sizes)
        self._sizes.frombytes(other.sizes.astype(np.int32).tobytes())
        self._doc_idx.frombytes((other.doc_idx[1:] + offset).astype(np.int64).tobytes())
        del other  # release the memmap before copying the file's bytes
        with open(data_file_path(other_prefix), "rb") as src:
            while True:
                chunk = src.read(16 * 1024 * 1024)
                if not chunk:
                    break
                self._bin_file.write(chunk)

    @property
    def num_items(self):
        return len(self._sizes)

    def finalize(self, idx_path):
        """Write the index and move `.bin` then `.idx` into place (each an atomic rename).
        Items added after the last end_document() form one last document."""
        self._close(self._bin_file)
        if self._doc_idx[-1] != len(self._sizes):
            self.end_document()
        sizes = np.frombuffer(self._sizes, dtype=np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        np.cumsum(sizes[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self._dtype.itemsize
        tmp_idx_path = _temp_path(idx_path)
        try:
            with open(tmp_idx_path, "wb") as f:
                f.write(_HEADER.pack(_MAGIC, _VERSION, dtype_code(self._dtype), len(sizes),
                                     len(self._doc_idx)))
                f.write(sizes.tobytes())
                f.write(pointers.tobytes())
                f.write(np.frombuffer(self._doc_idx, dtype=np.int64).tobytes())
                self._close(f)
        except BaseException:
            if os.path.exists(tmp_idx_path):
                os.remove(tmp_idx_path)
            raise
        # Remove the old index first: a reader then sees "missing", never a new .bin paired
        # with an old .idx.
        if os.path.exists(idx_path):
            os.remove(idx_path)
        os.replace(self._tmp_bin_path, self._bin_path)
        os.replace(tmp_idx_path, idx_path)

    @staticmethod
    def _close(f):
        if not f.closed:
            f.flush()
            os.fsync(f.fileno())
            f.close()

    def discard(self):
        """Drop everything written so far (temp file included)."""
        if not self._bin_file.closed:
            self._bin_file.close()
        if os.path.exists(self._tmp_bin_path):
            os.remove(self._tmp_bin_path)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if os.path.exists(self._tmp_bin_path):  # not finalized: an error or an early return
            self.discard()
        return False
