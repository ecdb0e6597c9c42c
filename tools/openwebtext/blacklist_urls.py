"""Clean Reddit-style URL lists: drop malformed, too short, blacklisted and duplicate URLs.

    python tools/openwebtext/blacklist_urls.py urls/ more_urls.txt --output clean_urls.txt \
        [--domain-blacklist my_domains.txt] [--extension-blacklist my_exts.txt] [--workers 4]

Inputs are files with one URL per line, or directories of them.  A URL is dropped, checking in
this order, when it is
  1. too short: at most --min-length (8) characters,
  2. malformed: not valid UTF-8, whitespace inside, not http(s), or no valid host name,
  3. on the domain blacklist: its host is a listed domain or a subdomain of one
     (a built-in list of image/video/social/file hosts, plus --domain-blacklist files),
  4. on the extension blacklist: its path ends in a listed extension (.jpg, .mp4, .zip, .pdf,
     ... plus --extension-blacklist files),
  5. a duplicate of an earlier URL (exact string; out of core, memory flat).
Kept URLs are written in input order; a summary counts each reason.
"""

import argparse
import ipaddress
import os
import re
import sys
from urllib.parse import urlsplit

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.errors import DataError  # noqa: E402
from tools.openwebtext.external import (add_bucket_arg, bucket_bytes,  # noqa: E402
                                        filter_then_dedup_lines)
from tools.openwebtext.streaming import (MALFORMED, Malformed, input_files,  # noqa: E402
                                         stage_main)

# Hosts whose pages are images, video, social-media shells or file downloads, not prose.
DEFAULT_DOMAIN_BLACKLIST = frozenset("""
    imgur.com i.redd.it v.redd.it reddit.com redd.it youtube.com youtu.be vimeo.com
    dailymotion.com twitch.tv gfycat.com giphy.com tenor.com flickr.com instagram.com
    pinterest.com tumblr.com facebook.com fb.com twitter.com x.com t.co tiktok.com
    snapchat.com linkedin.com soundcloud.com spotify.com bandcamp.com streamable.com
    liveleak.com dropbox.com drive.google.com docs.google.com mega.nz mediafire.com
    4shared.com github.com gitlab.com amazon.com ebay.com bit.ly tinyurl.com goo.gl
    ow.ly discord.gg discord.com deviantart.com photobucket.com gyazo.com puu.sh
    prntscr.com postimg.cc ibb.co steamcommunity.com store.steampowered.com
""".split())

DEFAULT_EXTENSION_BLACKLIST = frozenset("""
    .jpg .jpeg .png .gif .gifv .bmp .svg .webp .ico .tif .tiff .heic .psd
    .mp4 .m4v .avi .mov .mkv .webm .flv .wmv .mpg .mpeg .3gp
    .mp3 .wav .ogg .flac .m4a .aac .wma .mid .midi
    .zip .tar .gz .tgz .bz2 .xz .7z .rar .iso .dmg .exe .msi .apk .deb .rpm .bin .jar
    .pdf .doc .docx .xls .xlsx .ppt .pptx .odt .ods .odp .rtf .epub .mobi .csv
    .js .css .json .xml .rss .woff .woff2 .ttf .otf .swf .torrent
""".split())

_HOST_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")
_TLD = re.compile(r"^(?:[a-z]{2,63}|xn--[a-z0-9-]{1,59})$")


def read_list_file(path, what):
    """Entries of a blacklist file: one per line, lowercased; '#' starts a comment."""
    try:
        with open(path, encoding="utf-8") as f:
            entries = [line.split("#", 1)[0].strip().lower() for line in f]
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read the {what} {path}: {e}") from None
    return {entry for entry in entries if entry}


def host_of(url):
    """The lowercased host name of a valid http(s) URL; raises Malformed otherwise."""
    if any(c.isspace() for c in url):
        raise Malformed(f"{MALFORMED}: whitespace inside the URL")
    try:
        parts = urlsplit(url)
        host = parts.hostname
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        raise Malformed(f"{MALFORMED}: not a parseable URL") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise Malformed(f"{MALFORMED}: not an http(s) URL")
    if not host:
        raise Malformed(f"{MALFORMED}: no host")
    try:
        host = host.encode("idna").decode("ascii")  # bücher.de -> xn--bcher-kva.de
    except UnicodeError:
        raise Malformed(f"{MALFORMED}: invalid host name") from None
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    if len(labels) < 2 or not _TLD.match(labels[-1]) or \
            not all(_HOST_LABEL.match(label) for label in labels):
        raise Malformed(f"{MALFORMED}: invalid host name")
    return ".".join(labels)


def domain_is_listed(host, blacklist):
    """True when `host` or one of its parent domains (not the bare TLD) is listed."""
    labels = host.split(".")
    return any(".".join(labels[i:]) in blacklist for i in range(len(labels) - 1))


class UrlFilter:
    """line -> (clean URL line, None) or (None, reason); picklable for spawned workers."""

    def __init__(self, domains, extensions, min_length):
        self.domains, self.extensions, self.min_length = domains, extensions, min_length

    def filter(self, line):
        try:
            url = line.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise Malformed(f"{MALFORMED}: invalid UTF-8") from None
        if len(url) <= self.min_length:
            return None, f"too short (<= {self.min_length} characters)"
        host = host_of(url)
        if domain_is_listed(host, self.domains):
            return None, "domain blacklist"
        extension = os.path.splitext(urlsplit(url).path)[1].lower()
        if extension in self.extensions:
            return None, "extension blacklist"
        return url.encode("utf-8") + b"\n", None


class _FilterFactory:
    def __init__(self, url_filter):
        self.url_filter = url_filter

    def __call__(self):
        return self.url_filter.filter


def get_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("inputs", nargs="+", help="URL files or directories of URL files")
    parser.add_argument("--output", required=True, help="the clean URL list to write")
    parser.add_argument("--domain-blacklist", action="append", default=[], metavar="FILE",
                        help="extra domains to drop, one per line (subdomains dropped too)")
    parser.add_argument("--extension-blacklist", action="append", default=[], metavar="FILE",
                        help="extra file extensions to drop, one per line (e.g. .txt)")
    parser.add_argument("--no-default-blacklists", action="store_true",
                        help="use only the --domain-blacklist/--extension-blacklist files")
    parser.add_argument("--min-length", type=int, default=8,
                        help="URLs of at most this many characters are dropped")
    parser.add_argument("--workers", type=int, default=1)
    add_bucket_arg(parser, "deduplication")
    return parser.parse_args(argv)


def build_filter(args):
    domains = set() if args.no_default_blacklists else set(DEFAULT_DOMAIN_BLACKLIST)
    extensions = set() if args.no_default_blacklists else set(DEFAULT_EXTENSION_BLACKLIST)
    for path in args.domain_blacklist:
        domains |= read_list_file(path, "domain blacklist")
    for path in args.extension_blacklist:
        extensions |= {e if e.startswith(".") else "." + e
                       for e in read_list_file(path, "extension blacklist")}
    return UrlFilter(frozenset(domains), frozenset(extensions), args.min_length)


def run(args, stream=None):
    """Filter, then drop duplicates; returns the StageReport."""
    url_filter, buckets = build_filter(args), bucket_bytes(args)
    return filter_then_dedup_lines("blacklist_urls", input_files(args.inputs), args.output,
                                   _FilterFactory(url_filter), args.workers, stream,
                                   lambda line: line.rstrip(b"\n"), "duplicate", buckets)


def main(argv=None):
    return stage_main(run, get_args, argv)


if __name__ == "__main__":
    sys.exit(main())
