"""`zephon shard`: convert JSONL, JSONL.gz, Parquet, Arrow (save_to_disk), .json (lines, or an
array of records), CSV (.csv, .tsv) or a folder of text files into seekable multi-frame JSONL.zst
shards (images with captions into tar shards), from and to S3 too.

    zephon shard SRC DST [--target-size 128MiB] [--frame-size 256KiB] [--text-field text]
                 [--image-field png;jpg] [--name shard] [--on-bad-record error|skip]
                 [--endpoint-url URL] [--region R] [--addressing-style path]

Progress goes to stderr: a tqdm bar on a terminal, a plain line every 5 s otherwise. The last
line on stdout sums up what was written.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from zephon_stream.errors import ZephonError

__all__ = ["add_subparser", "parse_size"]

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000 ** 2, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1000 ** 3, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes from `"128MiB"`, `"64M"` (binary), `"1GB"` (decimal) or a plain number."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write e.g. 128MiB, 64M, 1GB or 1048576")
    size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be at least 1 byte")
    return size


def add_subparser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `shard` command to an argparse subparsers object (it sets `func`)."""
    p = subparsers.add_parser("shard", help="convert JSONL(.gz), Parquet, Arrow, .json, CSV or text into shards",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="input: a file or folder (local path, file://, s3://bucket/prefix/)")
    p.add_argument("dst", help="output folder (local path, file://, s3://bucket/prefix/)")
    p.add_argument("--target-size", type=parse_size, default=128 << 20, metavar="SIZE",
                   help="compressed bytes per shard (default 128MiB)")
    p.add_argument("--frame-size", type=parse_size, default=256 << 10, metavar="SIZE",
                   help="input bytes per zstd frame: the finest split a lane can take (default 256KiB)")
    p.add_argument("--text-field", metavar="NAME",
                   help="the JSON field or Parquet column (dotted for nested) with the text (default text); with "
                        "--image-field, the caption: a file extension beside each image (default txt), or a "
                        "Parquet column (default text)")
    p.add_argument("--image-field", metavar="NAME",
                   help="write tar shards of images: image file extensions (png;jpg) or a Parquet image column")
    p.add_argument("--messages-field", metavar="NAME",
                   help="chat data: the JSON field or Parquet column with each conversation (a list of {role, "
                        "content} messages); records are checked as a chat source reads them")
    p.add_argument("--tools-field", metavar="NAME",
                   help="chat data: the field or column with each conversation's tools (kept beside it)")
    p.add_argument("--documents-field", metavar="NAME",
                   help="chat data: the field or column with each conversation's retrieved documents (kept beside it)")
    p.add_argument("--delimiter", metavar="CHAR",
                   help="CSV inputs: the one character between values (default: ',' for .csv, tab for .tsv); "
                        "';' for many spreadsheet exports, '\\t' for a tab")
    p.add_argument("--name", default="shard", help="shard names: NAME-00000.jsonl.zst, ... (default shard)")
    p.add_argument("--on-bad-record", choices=["error", "skip"], default="error",
                   help="stop at a bad record (default), or skip and count it")
    p.add_argument("--max-record-bytes", type=parse_size, default=16 << 20, metavar="SIZE",
                   help="the largest record (or text file, image) taken (default 16MiB)")
    p.add_argument("--endpoint-url", help="S3 endpoint (default: AWS); credentials come from the environment")
    p.add_argument("--region", help="S3 region")
    p.add_argument("--addressing-style", choices=["auto", "path", "virtual"], help="S3 addressing style")
    p.add_argument("--profile", help="S3: a profile of the AWS config files (default: the environment's)")
    p.set_defaults(func=_run)
    return p


def _run(args: argparse.Namespace) -> int:
    from zephon_stream.shard import shard

    options = {k: v for k, v in (("endpoint_url", args.endpoint_url), ("region", args.region),
                                 ("addressing_style", args.addressing_style), ("profile", args.profile))
               if v is not None}
    try:
        report = shard(args.src, args.dst, target_bytes=args.target_size, frame_bytes=args.frame_size,
                       text_field=args.text_field, image_field=args.image_field, name=args.name,
                       on_bad=args.on_bad_record, max_record_bytes=args.max_record_bytes,
                       messages_field=args.messages_field, tools_field=args.tools_field,
                       documents_field=args.documents_field,
                       delimiter=args.delimiter, **options)
    except ZephonError as exc:
        print(f"zephon shard: error: {_as_flags(str(exc))}", file=sys.stderr)
        for note in getattr(exc, "__notes__", []):
            print(f"  {_as_flags(note)}", file=sys.stderr)
        return 2  # a bad input is the user's to fix, as a bad setting is: every zephon command says 2
    skipped = f", {_count(report.skipped, 'bad record')} skipped" if report.skipped else ""
    print(f"{_count(report.documents, 'document')} from {_count(report.inputs, 'input')} ({report.bytes_in} bytes) "
          f"into {_count(len(report.shards), 'shard')} ({report.bytes_out} bytes){skipped}")
    if not report.documents:  # exit 0 and no folder made: a source over it failed later, as "does not exist"
        why = "every record was bad and skipped" if report.skipped else "they hold no record (empty, or no rows)"
        print(f"zephon shard: error: no document to write from {args.src}: {why}; {args.dst} was not written",
              file=sys.stderr)
        return 2
    return 0


# The library's errors name its settings; on this command line they are flags. (And the readers
# call what they read a shard; here it is an input.)
_FLAGS = ((re.compile(r"^empty shard "), "empty input "),
          (re.compile(r'\bset on_bad_record = "skip"'), "pass --on-bad-record skip"),
          (re.compile(r'\bon_bad_record = "(\w+)"'), r"--on-bad-record \1"),
          (re.compile(r"\braise max_record_bytes\b"), "raise --max-record-bytes"),
          (re.compile(r"\bmax_record_bytes ?= ?(\d+)"), r"--max-record-bytes \1"),
          (re.compile(r"\bmax_record_bytes\b"), "--max-record-bytes"),
          (re.compile(r"\bset (text|image|messages|tools|documents)_field to one of them\b"),
           r"pass one of them to --\1-field"),
          (re.compile(r"\b(messages|tools|documents)_field\b"), r"--\1-field"),
          (re.compile(r"\(text_field\)"), "(--text-field)"),
          (re.compile(r"\(image_field\)"), "(--image-field)"),
          (re.compile(r"\bpass delimiter=('[^']*')"), r"pass --delimiter \1"),
          # the loader maps records (a source's [[sources.transforms]]); zephon shard copies them as they are
          (re.compile(r"with a map step\)"),
           "with a map step of a loader source, [[sources.transforms]]: zephon shard copies records as they are, "
           "so give such files to the loader as they are)"))


def _as_flags(message: str) -> str:
    """`message` with the settings it names written as this command's flags."""
    for pattern, flag in _FLAGS:
        message = pattern.sub(flag, message)
    return message


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")
