"""Group near-duplicate documents: connected components of the pairs at or above a threshold.

    python tools/openwebtext/group_duplicates_url.py duplicates.jsonl groups.jsonl [--threshold 0.8]

Reads find_duplicates.py's pairs; two documents joined through any chain of pairs with
Jaccard >= --threshold fall in one group.  Each output line is one group, a JSON list of URLs
ordered by document position in the deduplicated corpus (the first one is the keeper).
Memory grows with the number of duplicate documents only, not with the corpus.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.errors import ConfigError  # noqa: E402
from tools.openwebtext.streaming import (MALFORMED, AtomicOutput, Progress,  # noqa: E402
                                         StageReport, input_files, iter_lines,
                                         stage_main)


class UnionFind:
    def __init__(self):
        self.parent = {}

    def find(self, item):
        self.parent.setdefault(item, item)
        root = item
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[item] != root:  # path compression
            self.parent[item], item = root, self.parent[item]
        return root

    def union(self, a, b):
        root_a, root_b = self.find(a), self.find(b)
        if root_a != root_b:
            self.parent[max(root_a, root_b)] = min(root_a, root_b)  # the earliest is the root


def _read_pair(line):
    try:
        pair = json.loads(line)
        return (int(pair["index"]), pair["url"]), (int(pair["duplicate_index"]),
                                                    pair["duplicate"]), float(pair["jaccard"])
    except (ValueError, KeyError, TypeError):  # UnicodeDecodeError is a ValueError
        return None


def group_pairs(pairs_path, threshold, report):
    """{root: [(index, url), ...]} over the pairs at or above `threshold`."""
    components = UnionFind()
    progress = Progress("group_duplicates_url", os.path.getsize(pairs_path))
    try:
        for offset, line in iter_lines(pairs_path, 0, os.path.getsize(pairs_path)):
            progress.update(1, len(line))
            if not line.strip():
                continue
            report.read += 1
            pair = _read_pair(line)
            if pair is None:
                report.count_drop(f"{MALFORMED}: not a find_duplicates.py pair",
                                  (pairs_path, offset))
                continue
            first, second, similarity = pair
            if similarity < threshold:
                report.count_drop(f"Jaccard below {threshold}")
                continue
            report.kept += 1
            components.union(first, second)
    finally:
        progress.close()
    groups = {}
    for member in components.parent:
        groups.setdefault(components.find(member), []).append(member)
    return groups


def get_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("input", help="pairs from find_duplicates.py")
    parser.add_argument("output", help="groups to write, one JSON list of URLs per line")
    parser.add_argument("--threshold", type=float, default=0.8,
                        help="join pairs with at least this Jaccard similarity")
    return parser.parse_args(argv)


def run(args, stream=None):
    if not 0.0 < args.threshold <= 1.0:
        raise ConfigError(f"--threshold must lie in (0, 1], got {args.threshold}")
    started = time.perf_counter()
    path = input_files([args.input])[0]
    report = StageReport("group_duplicates_url", bytes_in=os.path.getsize(path))
    groups = group_pairs(path, args.threshold, report)
    with AtomicOutput(args.output) as out:
        for root in sorted(groups):
            members = sorted(groups[root])
            out.write(json.dumps([url for _, url in members], ensure_ascii=False).encode()
                      + b"\n")
    report.bytes_out = os.path.getsize(args.output)
    report.notes.update({"groups": len(groups),
                         "documents in groups": sum(len(g) for g in groups.values())})
    report.seconds = time.perf_counter() - started
    return report


def main(argv=None):
    return stage_main(run, get_args, argv)


if __name__ == "__main__":
    sys.exit(main())
