"""Merge downloaded pages (loose JSON files of {"text", "url"} lines) into one loose JSON file.

    python tools/openwebtext/merge_jsons.py --json-path pages/ --output-file merged.json \
        [--workers 4]

Every `*.json`/`*.jsonl` file under --json-path (and any files named after it) is read line by
line.  A line is kept when it is a JSON object with string "text" and "url" values and a
non-blank text; it is written back as one compact UTF-8 JSON line (other keys kept).  Lines that
are not valid UTF-8 or JSON, or lack the keys, are counted as malformed and skipped.  A page
whose URL was already seen (downloaded twice) is dropped as a duplicate, out of core.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tools.openwebtext.external import (add_bucket_arg, bucket_bytes,  # noqa: E402
                                        filter_then_dedup_lines)
from tools.openwebtext.streaming import (dump_json_line, input_files,  # noqa: E402
                                         parse_json_record, stage_main)

JSON_SUFFIXES = (".json", ".jsonl")


def page_filter(line):
    record = parse_json_record(line, ("text", "url"))
    if not record["text"].strip():
        return None, "empty text"
    return dump_json_line(record), None


def _make_page_filter():
    return page_filter


def url_of_json_line(line):
    return json.loads(line)["url"].encode("utf-8", "surrogatepass")


def get_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json-path", "--json_path", dest="json_path", action="append",
                        required=True, help="a directory of *.json/*.jsonl page files, or a "
                        "file; repeat for more")
    parser.add_argument("--output-file", "--output_file", dest="output_file", required=True)
    parser.add_argument("--workers", type=int, default=1)
    add_bucket_arg(parser, "URL deduplication")
    return parser.parse_args(argv)


def run(args, stream=None):
    buckets = bucket_bytes(args)
    return filter_then_dedup_lines("merge_jsons", input_files(args.json_path, JSON_SUFFIXES),
                                   args.output_file, _make_page_filter, args.workers, stream,
                                   url_of_json_line, "duplicate url", buckets)


def main(argv=None):
    return stage_main(run, get_args, argv)


if __name__ == "__main__":
    sys.exit(main())
