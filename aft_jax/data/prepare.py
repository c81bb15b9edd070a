"""Prepare a corpus: download or read, build TFDS, tokenise, cache token ids.

    python -m aft_jax.data.prepare --dataset wikitext103 [--data_dir DIR] \\
        [--manual_dir DIR] [--variant v1|raw_v1] [--tokenizer word|byte|subword] \\
        [--vocab_size N] [--nodownload]
    python -m aft_jax.data.prepare --dataset enwik8 [--data_dir DIR] [--manual_dir DIR] \\
        [--nodownload]
    python -m aft_jax.data.prepare --dataset text --train_files GLOBS [--valid_files GLOBS] \\
        [--test_files GLOBS] [--tokenizer byte|word|subword] [--vocab_size N] [--text_field F]

prints progress and the folder it prepared on stderr and, as its last stdout line, one JSON
object:
    {"vocab_size": V, "tokens": {"train": N, "validation": N, "test": N}}

Without --data_dir it prepares into `aft_jax.data.config.default_data_dir()` ($AFT_JAX_DATA,
else ~/.cache/aft_jax), where the trainer looks when config.data.data_dir is empty. Two runs on
one corpus take turns (a lock file beside it): the second waits, then reuses the first's result.

A second run finds `<data_dir>/prepared/<name>/COMPLETE` and only prints the
summary, unless the source files found now differ from the ones it was prepared
from (their fingerprint, `store.fingerprint`, is kept in summary.json): then
it prepares again. The byte tokenizer always reads the raw release (`raw_v1`).

`--official` says whether the source must be the published data:
* WikiText-103, `auto` (default): files whose line count is the official one
  for at least one split are taken to be the official release, so every count
  must then be the published one (267,735 words and 103,227,021 / 217,646 /
  245,569 tokens for v1 words); otherwise the error says the files look
  truncated or modified, and that `--official no` prepares them as a custom
  corpus in the same layout. Files with no official line count at all are a
  custom corpus (with a warning). `yes` requires the published counts, `no`
  never checks them.
* enwik8: `auto` prepares a file of any size (one that is not 100,000,000
  bytes with a warning that it is a custom byte corpus), `yes` requires
  100,000,000 bytes, `no` says nothing.
Any mismatch is a `CountMismatchError` and nothing is marked complete.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator

import numpy as np

from aft_jax.ctrl_c import stops_on_ctrl_c
from aft_jax.data import pydoc, record, store
from aft_jax.data.config import (
  DATASETS,
  OFFICIAL,
  TOKENIZERS,
  VARIANTS,
  DataConfig,
  resolve_data_dir,
)
from aft_jax.data import vocab as vocab_lib

log = logging.getLogger(__name__)

# Published statistics of wikitext-103-v1 under the word protocol (one <eos>
# per line): Merity et al. 2016, Table 1.
OFFICIAL_VOCAB_SIZE = 267_735
OFFICIAL_TOKENS = {"train": 103_227_021, "validation": 217_646, "test": 245_569}
# Lines per split file (identical in both releases); how real data is recognised.
OFFICIAL_LINES = {"train": 1_801_350, "validation": 3_760, "test": 4_358}

SPLITS = ("train", "validation", "test")
# --official / config.data.official -> the `official` argument of the prepare functions.
OFFICIAL_CHOICES = dict(zip(OFFICIAL, (None, True, False)))


class CountMismatchError(ValueError):
  """Real WikiText-103 did not give the published counts."""


def resolve_variant(tokenizer: str, variant: str | None) -> str:
  """The release a tokenizer reads: bytes always come from the raw text."""
  if tokenizer not in TOKENIZERS:
    raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {tokenizer!r}")
  if tokenizer == "byte":
    if variant not in (None, "", "raw_v1"):
      log.warning("The byte tokenizer reads raw_v1, not %s.", variant)
    return "raw_v1"
  variant = variant or "v1"
  if variant not in VARIANTS:
    raise ValueError(f"variant must be 'v1' or 'raw_v1', got {variant!r}")
  return variant


def corpus_name(variant: str, tokenizer: str, vocab_size: int = 0) -> str:
  size = str(vocab_size) if tokenizer == "subword" else ""
  return f"wikitext103-{variant}-{tokenizer}{size}"


def _records(builder, split: str, key: str, unit: str, progress: bool) -> Iterator[bytes]:
  """Field `key` of a built split's examples, in file order."""
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top

  ds = builder.as_data_source(split)
  step = 256
  with tqdm(
    total=len(ds), desc=f"{split} {unit}", unit=unit[:3], disable=not progress, file=sys.stderr
  ) as bar:
    for start in range(0, len(ds), step):
      for rec in ds.__getitems__(list(range(start, min(start + step, len(ds))))):
        yield rec[key]
      bar.update(min(step, len(ds) - start))


def _articles(builder, split: str, progress: bool) -> Iterator[str]:
  """Article texts of a built WikiText-103 split, in file order."""
  for text in _records(builder, split, "text", "articles", progress):
    yield text.decode("utf-8")


def check_official(
  summary: dict, lines: dict[str, int], *, variant: str, tokenizer: str, official: bool | None
) -> bool:
  """Checks the published counts on real data; returns whether it is real.

  `official=None` recognises real data by its line counts; True insists on it.
  """
  if official is None:
    # One split with its official line count: these are the official files (a custom corpus in
    # the same layout would not hit 1,801,350, 3,760 or 4,358 lines), maybe partly damaged.
    is_real = any(lines[s] == OFFICIAL_LINES[s] for s in SPLITS)
    if not is_real:
      log.warning(
        "WikiText-103 (%s): no split has its official line count %s; prepared as a custom corpus.",
        variant,
        OFFICIAL_LINES,
      )
  else:
    is_real = official
  if not is_real:
    return False
  problems = [
    f"{s}: {lines[s]:,} lines, expected {OFFICIAL_LINES[s]:,}"
    for s in SPLITS
    if lines[s] != OFFICIAL_LINES[s]
  ]
  if variant == "v1" and tokenizer == "word":
    if summary["vocab_size"] != OFFICIAL_VOCAB_SIZE:
      problems.append(
        f"vocabulary: {summary['vocab_size']:,} words, expected {OFFICIAL_VOCAB_SIZE:,}"
      )
    problems += [
      f"{s}: {summary['tokens'][s]:,} tokens, expected {OFFICIAL_TOKENS[s]:,}"
      for s in SPLITS
      if summary["tokens"][s] != OFFICIAL_TOKENS[s]
    ]
  if problems:
    hint = (
      "The files have the official names and some official counts, so they look truncated or "
      "modified: restore them (or fetch the zip again), or prepare them as a custom corpus in "
      "the same layout with --official no (cfg.official = 'no')."
      if official is None
      else "The source files are not the official ones or are damaged."
    )
    raise CountMismatchError(
      f"WikiText-103 ({variant}, {tokenizer}) does not match the published statistics: "
      + "; ".join(problems)
      + f". {hint}"
    )
  return True


def prepare_wikitext103(
  data_dir: str,
  *,
  manual_dir: str | None = None,
  variant: str | None = None,
  tokenizer: str = "word",
  vocab_size: int = 0,
  download: bool = True,
  official: bool | None = None,
  progress: bool = True,
) -> dict:
  """Builds `<data_dir>/prepared/wikitext103-<variant>-<tokenizer>/`; returns its summary.

  `tokenizer='subword'` learns a SentencePiece vocabulary of `vocab_size` pieces on the train
  articles (`aft_jax.data.subword`), each article followed by its `<eos>`.

  Reuses a complete earlier result. Raises `wikitext103.WikiTextError` for
  bad or missing source data and `CountMismatchError` (see module docstring).
  """
  variant = resolve_variant(tokenizer, variant)
  if not data_dir:
    raise ValueError("data_dir is required to prepare wikitext103")
  if tokenizer == "subword":  # the config's rule for the size (aft-prepare --vocab_size)
    DataConfig(dataset="wikitext103", tokenizer="subword", vocab_size=vocab_size).validate()
  data_dir = os.path.expanduser(data_dir)
  name = corpus_name(variant, tokenizer, vocab_size)
  out = store.prepared_dir(data_dir, name)
  from aft_jax.data import wikitext103  # pylint: disable=g-import-not-at-top  (TFDS is slow to import)

  locate = functools.partial(wikitext103.locate_source, variant)
  with store.lock(out, name):
    summary = store.reusable(
      out, _fingerprint_now(locate, data_dir, manual_dir), record.version("wikitext103")
    )
    if summary is not None:
      return summary
    _quiet_tfds(progress)
    builder = wikitext103.build(
      variant,
      data_dir=os.path.join(data_dir, "tfds"),
      manual_dir=manual_dir or None,
      download=download,
    )
    if tokenizer == "subword":
      return _write_wikitext103_subword(builder, out, variant, vocab_size, official, progress)
    return _write_wikitext103(builder, out, variant, tokenizer, official, progress)


def _write_wikitext103_subword(builder, out, variant, vocab_size, official, progress) -> dict:
  """`_write_wikitext103` for a subword vocabulary learned on the train articles: each article
  a document, as in a text corpus (`aft_jax.data.text`), with its bytes for bits per byte."""
  from aft_jax.data import subword, text  # pylint: disable=g-import-not-at-top

  store.start(out)
  vocab = subword.train(
    _articles(builder, "train", progress),
    vocab_size,
    what=f"the WikiText-103 {variant} train split",
  )
  recorded = text.save_vocab(vocab, out)
  tokens, lines, num_bytes = {}, {}, {}
  for split in SPLITS:
    articles = list(_articles(builder, split, progress))
    lines[split] = sum(a.count("\n") for a in articles)
    chunks, num_bytes[split] = text.encode_documents(vocab, articles)
    tokens[split] = store.write_tokens(out, split, chunks)
    del chunks, articles
  summary = {"vocab_size": vocab.size, "tokens": tokens}
  real = check_official(summary, lines, variant=variant, tokenizer="subword", official=official)
  name = corpus_name(variant, "subword", vocab_size)
  store.finish(
    out,
    {
      **summary,
      "name": name,
      "variant": variant,
      "tokenizer": "subword",
      "bytes": num_bytes,
      "lines": lines,
      "official": real,
      **recorded,
      **_fingerprint_of(builder),
    },
  )
  return summary


def _write_wikitext103(builder, out, variant, tokenizer, official, progress) -> dict:
  """Tokenises a built WikiText-103 into `out` (under its lock); returns the summary."""
  store.start(out)
  tokens, lines = {}, {}
  if tokenizer == "word":
    counts = vocab_lib.count_words(_articles(builder, "train", progress))
    # raw_v1 has real words where v1 has <unk>; held-out words unseen in train
    # need an id, so its vocabulary gets an explicit <unk>.
    vocab = vocab_lib.WordVocab.build(counts, add_unk=variant == "raw_v1")
    vocab.save(os.path.join(out, vocab_lib.VOCAB_FILENAME))
    encode = vocab.encode
  else:
    vocab = vocab_lib.ByteVocab()
    encode = lambda text: np.frombuffer(text.encode("utf-8"), np.uint8)  # noqa: E731
  for split in SPLITS:
    try:
      chunks = [encode(text) for text in _articles(builder, split, progress)]
    except ValueError as e:  # a v1 held-out word missing from train: not the official data
      raise ValueError(f"{variant} {split} split: {e}; the official v1 has no such words") from e
    lines[split] = int(sum(np.count_nonzero(c == vocab.eos_id) for c in chunks))
    tokens[split] = store.write_tokens(out, split, chunks)
    del chunks
  summary = {"vocab_size": vocab.size, "tokens": tokens}
  real = check_official(summary, lines, variant=variant, tokenizer=tokenizer, official=official)
  store.finish(
    out,
    {
      **summary,
      "name": corpus_name(variant, tokenizer),
      "variant": variant,
      "tokenizer": tokenizer,
      "lines": lines,
      "official": real,
      **_fingerprint_of(builder),
    },
  )
  return summary


def _fingerprint_now(locate, data_dir: str, manual_dir: str | None) -> Callable[[], str | None]:
  """A thunk giving the fingerprint of the source `locate` finds now (None: none found)."""
  from aft_jax.data import sources  # pylint: disable=g-import-not-at-top

  download_dir = os.path.join(data_dir, "tfds", "downloads")
  return lambda: sources.current_fingerprint(locate, manual_dir or None, download_dir)


def _fingerprint_of(builder) -> dict:
  """What summary.json records of a TFDS build: its source's fingerprint and the builder's
  version."""
  key = store.FINGERPRINT_KEY
  out = {key: builder.info.metadata.get(key)} if builder.info.metadata else {}
  return {**out, store.VERSION_KEY: record.version(builder.name)}


def _quiet_tfds(progress: bool) -> None:
  if not progress:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

    tfds.disable_progress_bar()  # TFDS's own bars; ours are switched off below


ENWIK8_NAME = "enwik8-byte"


def prepare_enwik8(
  data_dir: str,
  *,
  manual_dir: str | None = None,
  download: bool = True,
  official: bool | None = None,
  progress: bool = True,
) -> dict:
  """Builds `<data_dir>/prepared/enwik8-byte/` (byte ids, vocabulary 256); returns its summary.

  Reuses a complete earlier result prepared from the same source. Raises
  `sources.DataError` for bad or missing source data and `CountMismatchError`
  when `official` is True and the file is not 100,000,000 bytes.
  """
  if not data_dir:
    raise ValueError("data_dir is required to prepare enwik8")
  data_dir = os.path.expanduser(data_dir)
  out = store.prepared_dir(data_dir, ENWIK8_NAME)
  from aft_jax.data import enwik8  # pylint: disable=g-import-not-at-top  (TFDS is slow to import)

  with store.lock(out, ENWIK8_NAME):
    summary = store.reusable(
      out, _fingerprint_now(enwik8.locate_source, data_dir, manual_dir), record.version("enwik8")
    )
    if summary is not None:
      return summary
    _quiet_tfds(progress)
    builder = enwik8.build(
      data_dir=os.path.join(data_dir, "tfds"), manual_dir=manual_dir or None, download=download
    )
    return _write_enwik8(builder, out, official, progress)


def _write_enwik8(builder, out, official, progress) -> dict:
  """Copies a built enwik8's bytes into `out` (under its lock); returns the summary."""
  from aft_jax.data import enwik8  # pylint: disable=g-import-not-at-top

  store.start(out)
  tokens = {}
  for split in SPLITS:
    chunks = (
      np.frombuffer(c, np.uint8) for c in _records(builder, split, "bytes", "MiB", progress)
    )
    tokens[split] = store.write_tokens(out, split, chunks)
  total = sum(tokens.values())
  real = total == enwik8.NUM_BYTES
  if not real and official:
    raise CountMismatchError(
      f"enwik8 has {total:,} bytes, not the {enwik8.NUM_BYTES:,} of the real file: it is "
      "truncated or a different file; fetch enwik8.zip again, or drop --official yes "
      "(cfg.official = 'yes') to prepare it as a custom byte corpus."
    )
  if not real and official is None:
    log.warning(
      "enwik8 has %s bytes, not the %s of the real file: prepared as a custom byte corpus in the "
      "same layout (validation and test are N // 20 bytes each: %s).",
      f"{total:,}",
      f"{enwik8.NUM_BYTES:,}",
      tokens,
    )
  summary = {"vocab_size": vocab_lib.ByteVocab().size, "tokens": tokens}
  store.finish(
    out,
    {
      **summary,
      "name": ENWIK8_NAME,
      "tokenizer": "byte",
      "official": real and official is not False,
      **_fingerprint_of(builder),
    },
  )
  return summary


def _parse(argv):
  p = argparse.ArgumentParser(
    prog="python -m aft_jax.data.prepare",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument("--dataset", choices=DATASETS, default="wikitext103")
  p.add_argument(
    "--data_dir",
    default="",
    help=(
      "where TFDS data, downloads and token ids go; default: $AFT_JAX_DATA, else "
      "~/.cache/aft_jax, as the trainer (data.data_dir '')"
    ),
  )
  p.add_argument("--manual_dir", default="", help="holds the official zip or its extracted files")
  p.add_argument(
    "--variant",
    choices=("v1", "raw_v1"),
    default=None,
    help="v1 (tokenised, <unk>) or raw_v1; default v1 for words, raw_v1 for bytes",
  )
  p.add_argument(
    "--tokenizer",
    choices=TOKENIZERS,
    default=None,
    help="default: word for wikitext103, byte for pydoc",
  )
  p.add_argument(
    "--nodownload",
    dest="download",
    action="store_false",
    help="never use the network; fail if the data is not in manual_dir",
  )
  p.add_argument(
    "--official",
    choices=tuple(OFFICIAL_CHOICES),
    default="auto",
    help=(
      "require the published counts: auto = when the files look official (see above), "
      "no = prepare any files in the official layout as a custom corpus"
    ),
  )
  p.add_argument(
    "--vocab_size", type=int, default=0, help="--tokenizer subword: the number of pieces"
  )
  for split in ("train", "valid", "test"):
    p.add_argument(
      f"--{split}_files", default="", help=f"--dataset text: comma-separated globs ({split})"
    )
  p.add_argument(
    "--text_field",
    default="",
    help="--dataset text: the JSONL field / Parquet column of each record's text (default text)",
  )
  p.add_argument("--quiet", action="store_true", help="no progress bars")
  return p.parse_args(argv)


def main(argv=None) -> dict:
  """Runs the CLI; returns the summary it printed."""
  args = _parse(argv)
  logging.basicConfig(
    level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
  )
  official = OFFICIAL_CHOICES[args.official]
  # The trainer's own resolution, so that `aft-prepare` then `aft-train` meet in one folder.
  data_dir = resolve_data_dir(args.data_dir)
  if args.dataset == "pydoc":
    vocab, splits = pydoc.pydoc_splits(args.tokenizer or "byte")
    summary = {"vocab_size": vocab.size, "tokens": {k: int(v.size) for k, v in splits.items()}}
  elif args.dataset == "text":
    from aft_jax.data import text  # pylint: disable=g-import-not-at-top

    names = ("tokenizer", "vocab_size", "train_files", "valid_files", "test_files", "text_field")
    given = {k: getattr(args, k) for k in names if getattr(args, k)}
    cfg = DataConfig.of({"dataset": "text", **given}).validate()  # the command line's check
    out, summary = text.prepare_text(data_dir, cfg, progress=not args.quiet)
    name = os.path.basename(out)
  elif args.dataset == "enwik8":
    name = ENWIK8_NAME
    summary = prepare_enwik8(
      data_dir,
      manual_dir=args.manual_dir or None,
      download=args.download,
      official=official,
      progress=not args.quiet,
    )
  else:
    tokenizer = args.tokenizer or "word"
    name = corpus_name(resolve_variant(tokenizer, args.variant), tokenizer, args.vocab_size)
    summary = prepare_wikitext103(
      data_dir,
      manual_dir=args.manual_dir or None,
      variant=args.variant,
      tokenizer=tokenizer,
      vocab_size=args.vocab_size,
      download=args.download,
      official=official,
      progress=not args.quiet,
    )
  if args.dataset != "pydoc":  # pydoc is built in memory: nothing is written
    default = "" if args.data_dir else " (the default data_dir, which the trainer reads)"
    print(f"Prepared {name} in {store.prepared_dir(data_dir, name)}{default}", file=sys.stderr)
  summary = {
    "vocab_size": summary["vocab_size"],
    "tokens": {s: summary["tokens"][s] for s in SPLITS if s in summary["tokens"]},
  }
  sys.stderr.flush()
  print(json.dumps(summary), flush=True)
  return summary


def cli() -> None:
  """``aft-prepare`` and ``python -m aft_jax.data.prepare``: ``main`` with a bad or missing
  dataset as one line on stderr and exit status 1 (the message says what to do), and Ctrl-C
  as one line and exit status 130 (``aft_jax.ctrl_c``); either way nothing is marked prepared
  and no temporary file is left."""
  with stops_on_ctrl_c(
    "aft-prepare: interrupted (Ctrl-C): nothing was marked prepared; the same command prepares "
    "it again"
  ):
    try:
      main()
    except (ValueError, OSError) as e:  # OSError: e.g. a data_dir that cannot be written or locked
      sys.exit(f"error: {type(e).__name__}: {e}")


if __name__ == "__main__":
  cli()
