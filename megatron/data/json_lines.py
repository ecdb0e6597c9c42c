"""One line of a loose-JSON corpus (`{"text": ..., ...}` per line) read into its record.

A leading UTF-8 byte-order mark is ignored. Every way a line can be unreadable (bytes that
are not UTF-8, JSON that is invalid, nested
deeper than Python parses or holds a number Python will not convert, a value that is not an
object, a key missing or not a string) raises `MalformedLine` with a short reason, so the
tools that read corpora skip and count such lines instead of dying with a traceback.
"""

import json

# the first bytes of the compressed formats corpora are shipped in
_COMPRESSED_MAGIC = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz",
                     b"\x28\xb5\x2f\xfd": "zstd"}


def compression_of(path):
    """The compression format `path` is in ("gzip", "bzip2", "xz", "zstd"), or None: a
    compressed corpus read as lines would be all malformed lines, not one clear error."""
    with open(path, "rb") as f:
        head = f.read(6)
    return next((name for magic, name in _COMPRESSED_MAGIC.items() if head.startswith(magic)),
                None)


class MalformedLine(ValueError):
    """`kind`: what is wrong, one of a few categories (for counting); the message adds where."""

    def __init__(self, kind, detail=None):
        super().__init__(kind, detail)  # args as given, so it pickles
        self.kind, self.detail = kind, detail

    def __str__(self):
        return f"{self.kind} ({self.detail})" if self.detail else self.kind


def parse_record(line, required=()):
    """The JSON object on raw line `line` (bytes), with a string under every `required` key."""
    try:
        text = line.decode("utf-8").rstrip("\r\n").lstrip("\ufeff")  # a byte-order mark:
        # editors write it at the start of a file, and `cat` of such files at a line's start
    except UnicodeDecodeError as e:
        raise MalformedLine("invalid UTF-8", f"byte {e.start} of the line") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise MalformedLine("invalid JSON", f"{e.msg}, column {e.colno}") from None
    except RecursionError:
        raise MalformedLine("invalid JSON", "nested too deeply to parse") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise MalformedLine("invalid JSON", str(e).splitlines()[0][:120]) from None
    if not isinstance(record, dict):
        raise MalformedLine("not a JSON object", f"a {type(record).__name__}")
    for key in required:
        if key not in record:
            raise MalformedLine(f"no string under {key!r}",
                                f"no such key; has {sorted(record)[:5]}")
        if not isinstance(record[key], str):
            raise MalformedLine(f"no string under {key!r}", f"a {type(record[key]).__name__}")
    return record
