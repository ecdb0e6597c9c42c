"""Run the whole webtext pipeline, from URL lists and downloaded pages to `.bin/.idx`.

    python tools/openwebtext/run_pipeline.py --pages pages/ --work-dir owt_work \
        --vocab-file vocab.json --merge-file merges.txt [--urls url_lists/] [--workers 4]

Stages (outputs under --work-dir):
    blacklist_urls   --urls ...          -> clean_urls.txt      (only with --urls)
    merge_jsons      --pages ...         -> merged.json
    cleanup_dataset  merged.json         -> cleaned.json        (ftfy, language, --min-tokens)
    find_duplicates  cleaned.json        -> duplicates.jsonl    (MinHash LSH + exact Jaccard)
    group_duplicates duplicates.jsonl    -> groups.jsonl
    remove_duplicates cleaned.json       -> deduped.json        (one document per group)
    shuffle          deduped.json        -> --output-json       (default train_data.json)
    preprocess       --output-json       -> {--output-prefix}_text_document.bin/.idx
Each finished stage leaves a marker (`.stages/<stage>.json`, written atomically after its
output is complete) holding its settings and what it kept and dropped.  A rerun skips a stage
whose marker matches its settings and whose outputs exist; a stage that was killed midway (no
marker) runs again from scratch, and so does every stage after a stage that ran.  A table of
what each stage kept and dropped ends every run.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.cli import run_cli  # noqa: E402
from megatron.data.preprocessing import TokenizerFactory  # noqa: E402
from megatron.errors import ConfigError  # noqa: E402
from tools.openwebtext import (blacklist_urls, cleanup_dataset, find_duplicates,  # noqa: E402
                               group_duplicates_url, merge_jsons, remove_group_duplicates,
                               shuffle_jsons)
from tools.openwebtext.external import add_bucket_arg, bucket_bytes  # noqa: E402
from tools.openwebtext.stages import (Stage, files_identity, format_table,  # noqa: E402
                                      run_stages, tokenize_stage)


def get_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_argument_group("inputs and outputs")
    group.add_argument("--pages", nargs="+", required=True,
                       help="downloaded pages: directories of *.json/*.jsonl loose JSON files "
                            "with {\"text\", \"url\"} lines, or such files")
    group.add_argument("--urls", nargs="+", default=None,
                       help="URL lists (files or directories) to clean into clean_urls.txt")
    group.add_argument("--work-dir", required=True, help="every stage's output and marker")
    group.add_argument("--output-json", default=None,
                       help="the shuffled corpus (default: WORK_DIR/train_data.json); e.g. "
                            "data/webtext/data.json to train with --train-data webtext")
    group.add_argument("--output-prefix", default=None,
                       help="writes PREFIX_text_document.bin/.idx (default: WORK_DIR/webtext)")
    group.add_argument("--skip-preprocess", action="store_true",
                       help="stop after the shuffled loose JSON")
    group = parser.add_argument_group("URL filtering")
    group.add_argument("--domain-blacklist", action="append", default=[], metavar="FILE")
    group.add_argument("--extension-blacklist", action="append", default=[], metavar="FILE")
    group.add_argument("--min-url-length", type=int, default=8)
    cleanup_dataset.add_cleanup_args(parser)
    find_duplicates.add_dedup_args(parser)
    group = parser.add_argument_group("shuffle and runtime")
    group.add_argument("--seed", type=int, default=1234, help="shuffle seed")
    add_bucket_arg(group, "URL deduplication and the shuffle")
    group.add_argument("--workers", type=int, default=1, help="processes per stage")
    group.add_argument("--force", action="store_true", help="rerun every stage")
    return parser.parse_args(argv)


def build_stages(args):
    work = args.work_dir
    path = {name: os.path.join(work, name) for name in (
        "clean_urls.txt", "merged.json", "cleaned.json", "duplicates.jsonl", "groups.jsonl",
        "deduped.json")}
    output_json = args.output_json or os.path.join(work, "train_data.json")
    output_prefix = args.output_prefix or os.path.join(work, "webtext")
    ns = argparse.Namespace
    stages = []
    if args.urls:
        stages.append(Stage(
            "blacklist_urls", [path["clean_urls.txt"]],
            {"inputs": files_identity(args.urls), "domains": files_identity(args.domain_blacklist),
             "extensions": files_identity(args.extension_blacklist),
             "min_length": args.min_url_length},
            lambda: blacklist_urls.run(ns(
                inputs=args.urls, output=path["clean_urls.txt"],
                domain_blacklist=args.domain_blacklist,
                extension_blacklist=args.extension_blacklist, no_default_blacklists=False,
                min_length=args.min_url_length, workers=args.workers,
                bucket_mb=args.bucket_mb)),
            independent=True))  # pages were downloaded from these URLs; nothing reads its file
    cleanup_args = ns(input=path["merged.json"], output=path["cleaned.json"],
                      min_tokens=args.min_tokens, language=args.language,
                      language_chars=args.language_chars, langdetect_seed=args.langdetect_seed,
                      tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                      merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
                      workers=args.workers)
    dedup_args = ns(input=path["cleaned.json"], output=path["duplicates.jsonl"],
                    threshold=args.threshold, lsh_threshold=args.lsh_threshold,
                    shingle_size=args.shingle_size, num_perm=args.num_perm,
                    minhash_seed=args.minhash_seed, workers=args.workers)
    tokenizer = {"type": args.tokenizer_type, "files": files_identity(
        [f for f in (args.vocab_file, args.merge_file, args.tokenizer_model) if f])}
    stages += [
        Stage("merge_jsons", [path["merged.json"]], {"pages": files_identity(args.pages)},
              lambda: merge_jsons.run(ns(json_path=args.pages, output_file=path["merged.json"],
                                         workers=args.workers, bucket_mb=args.bucket_mb))),
        Stage("cleanup_dataset", [path["cleaned.json"]],
              {"min_tokens": args.min_tokens, "language": sorted(args.language),
               "language_chars": args.language_chars, "seed": args.langdetect_seed,
               "tokenizer": tokenizer},
              lambda: cleanup_dataset.run(cleanup_args)),
        Stage("find_duplicates", [path["duplicates.jsonl"]],
              {"threshold": args.threshold, "lsh_threshold": args.lsh_threshold,
               "shingle_size": args.shingle_size, "num_perm": args.num_perm,
               "seed": args.minhash_seed},
              lambda: find_duplicates.run(dedup_args)),
        Stage("group_duplicates", [path["groups.jsonl"]], {"threshold": args.threshold},
              lambda: group_duplicates_url.run(ns(input=path["duplicates.jsonl"],
                                                  output=path["groups.jsonl"],
                                                  threshold=args.threshold))),
        Stage("remove_duplicates", [path["deduped.json"]], {},
              lambda: remove_group_duplicates.run(ns(
                  groups=path["groups.jsonl"], input=path["cleaned.json"],
                  output=path["deduped.json"], workers=args.workers))),
        Stage("shuffle", [output_json], {"seed": args.seed, "bucket_mb": args.bucket_mb,
                                         "output": os.path.abspath(output_json)},
              lambda: shuffle_jsons.run(ns(input=path["deduped.json"], output=output_json,
                                           seed=args.seed, bucket_mb=args.bucket_mb,
                                           workers=args.workers))),
    ]
    if not args.skip_preprocess:
        prefix = f"{output_prefix}_text_document"
        stages.append(Stage(
            "preprocess", [prefix + ".bin", prefix + ".idx"],
            {"tokenizer": tokenizer, "output": os.path.abspath(prefix)},
            lambda: tokenize_stage(output_json, output_prefix, args)))
    return stages


def _check_outputs_outside_the_pages(args):
    """Outputs written under a --pages folder would be read back as pages by the next run."""
    outputs = {"--work-dir": args.work_dir, "--output-json": args.output_json}
    for page_dir in filter(os.path.isdir, args.pages):
        root = os.path.realpath(page_dir)
        for flag, path in outputs.items():
            resolved = os.path.realpath(path) if path is not None else None
            if resolved is not None and (resolved == root or resolved.startswith(root + os.sep)):
                raise ConfigError(f"{flag} {path} is inside --pages {page_dir}: the next run "
                                  "would read this run's outputs as pages; put it elsewhere")


def run(args):
    if args.workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {args.workers}")
    find_duplicates.check_dedup_args(args)
    bucket_bytes(args)  # checked now, not when the first stage that takes it runs
    _check_outputs_outside_the_pages(args)
    if args.min_tokens or not args.skip_preprocess:  # missing tokenizer files: now, not hours in
        TokenizerFactory(args.tokenizer_type, args.vocab_file, args.merge_file,
                         args.tokenizer_model)()
    started = time.perf_counter()
    reports = run_stages(build_stages(args), os.path.join(args.work_dir, ".stages"), args.force)
    print(format_table(reports, time.perf_counter() - started), flush=True)
    return reports


def main(argv=None):
    return run_cli(lambda: run(get_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
