"""Keep one document per group of near-duplicates.

    python tools/openwebtext/remove_group_duplicates.py groups.jsonl cleaned.json deduped.json \
        [--workers 4]

groups.jsonl comes from group_duplicates_url.py: each line a JSON list of URLs whose first
URL is kept; documents with any other URL of a group are dropped.  Documents outside every
group pass unchanged, in order.  Memory holds the URLs to drop only.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tools.openwebtext.streaming import (MALFORMED, StageReport, input_files,  # noqa: E402
                                         iter_lines, parse_json_record, run_line_filter,
                                         stage_main)


def urls_to_drop(groups_path, report):
    """Every URL of every group but the group's first."""
    drop = set()
    for offset, line in iter_lines(groups_path, 0, os.path.getsize(groups_path)):
        if not line.strip():
            continue
        try:
            group = json.loads(line)
            if not (isinstance(group, list) and all(isinstance(u, str) for u in group)):
                raise ValueError
        except ValueError:
            report.count_drop(f"{MALFORMED} groups line (not a JSON list of URLs)",
                              (groups_path, offset))
            continue
        drop.update(group[1:])
    return frozenset(drop)


class DropUrls:
    def __init__(self, drop):
        self.drop = drop

    def __call__(self):
        return self.filter

    def filter(self, line):
        if parse_json_record(line, ("text", "url"))["url"] in self.drop:
            return None, "near-duplicate"
        return line if line.endswith(b"\n") else line + b"\n", None


def get_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("groups", help="groups from group_duplicates_url.py")
    parser.add_argument("input", help="the loose JSON corpus the groups were found in")
    parser.add_argument("output", help="the corpus with one document per group")
    parser.add_argument("--workers", type=int, default=1)
    return parser.parse_args(argv)


def run(args, stream=None):
    started = time.perf_counter()
    groups_report = StageReport("groups")
    drop = urls_to_drop(input_files([args.groups])[0], groups_report)
    report = run_line_filter("remove_group_duplicates", input_files([args.input]), args.output,
                             DropUrls(drop), args.workers, stream)
    report.dropped.update(groups_report.dropped)
    report.examples.extend(groups_report.examples)
    report.seconds = time.perf_counter() - started
    return report


def main(argv=None):
    return stage_main(run, get_args, argv)


if __name__ == "__main__":
    sys.exit(main())
