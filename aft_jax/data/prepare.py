"""Prepare a corpus: download or read, build TFDS, tokenise, cache token ids.

    python -m aft_jax.data.prepare --dataset wikitext103 --data_dir DIR \\
        [--manual_dir DIR] [--variant v1|raw_v1] [--tokenizer word|byte] [--nodownload]

prints progress on stderr and, as its last stdout line, one JSON object:
    {"vocab_size": V, "tokens": {"train": N, "validation": N, "test": N}}

A second run finds `<data_dir>/prepared/<name>/COMPLETE` and only prints the
summary. The byte tokenizer always reads the raw release (`raw_v1`).

On the real WikiText-103 v1 data (recognised by its official line counts, or
forced with `--official yes`) the word-level result must be the published one:
267,735 words and 103,227,021 / 217,646 / 245,569 tokens; anything else is a
`CountMismatchError` and nothing is marked complete.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Iterator

import numpy as np

from aft_jax.data import store
from aft_jax.data import vocab as vocab_lib

log = logging.getLogger(__name__)

# Published statistics of wikitext-103-v1 under the word protocol (one <eos>
# per line): Merity et al. 2016, Table 1.
OFFICIAL_VOCAB_SIZE = 267_735
OFFICIAL_TOKENS = {"train": 103_227_021, "validation": 217_646, "test": 245_569}
# Lines per split file (identical in both releases); how real data is recognised.
OFFICIAL_LINES = {"train": 1_801_350, "validation": 3_760, "test": 4_358}

SPLITS = ("train", "validation", "test")
TOKENIZERS = ("word", "byte")


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
  if variant not in ("v1", "raw_v1"):
    raise ValueError(f"variant must be 'v1' or 'raw_v1', got {variant!r}")
  return variant


def corpus_name(variant: str, tokenizer: str) -> str:
  return f"wikitext103-{variant}-{tokenizer}"


def _articles(builder, split: str, progress: bool) -> Iterator[str]:
  """Article texts of a built split, in file order."""
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top

  ds = builder.as_data_source(split)
  step = 256
  with tqdm(
    total=len(ds), desc=f"{split} articles", unit="art", disable=not progress, file=sys.stderr
  ) as bar:
    for start in range(0, len(ds), step):
      for rec in ds.__getitems__(list(range(start, min(start + step, len(ds))))):
        yield rec["text"].decode("utf-8")
      bar.update(min(step, len(ds) - start))


def check_official(
  summary: dict, lines: dict[str, int], *, variant: str, tokenizer: str, official: bool | None
) -> bool:
  """Checks the published counts on real data; returns whether it is real.

  `official=None` recognises real data by its line counts; True insists on it.
  """
  is_real = lines == OFFICIAL_LINES if official is None else official
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
    raise CountMismatchError(
      f"WikiText-103 ({variant}, {tokenizer}) does not match the published statistics: "
      + "; ".join(problems)
      + ". The source files are not the official ones or are damaged."
    )
  return True


def prepare_wikitext103(
  data_dir: str,
  *,
  manual_dir: str | None = None,
  variant: str | None = None,
  tokenizer: str = "word",
  download: bool = True,
  official: bool | None = None,
  progress: bool = True,
) -> dict:
  """Builds `<data_dir>/prepared/wikitext103-<variant>-<tokenizer>/`; returns its summary.

  Reuses a complete earlier result. Raises `wikitext103.WikiTextError` for
  bad or missing source data and `CountMismatchError` (see module docstring).
  """
  variant = resolve_variant(tokenizer, variant)
  if not data_dir:
    raise ValueError("data_dir is required to prepare wikitext103")
  data_dir = os.path.expanduser(data_dir)
  out = store.prepared_dir(data_dir, corpus_name(variant, tokenizer))
  if store.is_complete(out):
    log.info("Reusing %s", out)
    return store.read_summary(out)

  from aft_jax.data import wikitext103  # pylint: disable=g-import-not-at-top  (TFDS is slow to import)

  if not progress:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

    tfds.disable_progress_bar()  # TFDS's own bars; ours are switched off below

  builder = wikitext103.build(
    variant,
    data_dir=os.path.join(data_dir, "tfds"),
    manual_dir=manual_dir or None,
    download=download,
  )
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
    },
  )
  return summary


def _parse(argv):
  p = argparse.ArgumentParser(
    prog="python -m aft_jax.data.prepare",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument("--dataset", choices=("wikitext103", "pydoc"), default="wikitext103")
  p.add_argument("--data_dir", default="", help="where TFDS data, downloads and token ids go")
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
    choices=("auto", "yes", "no"),
    default="auto",
    help=(
      "check the published WikiText-103 counts: auto = when the line counts are the official ones"
    ),
  )
  p.add_argument("--quiet", action="store_true", help="no progress bars")
  return p.parse_args(argv)


def main(argv=None) -> dict:
  """Runs the CLI; returns the summary it printed."""
  args = _parse(argv)
  logging.basicConfig(
    level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
  )
  if args.dataset == "pydoc":
    from aft_jax.data import corpus as corpus_lib  # pylint: disable=g-import-not-at-top

    c = corpus_lib.pydoc_corpus(args.tokenizer or "byte")
    summary = {"vocab_size": c.vocab.size, "tokens": {k: int(v.size) for k, v in c.splits.items()}}
  else:
    if not args.data_dir:
      raise SystemExit("--data_dir is required for --dataset wikitext103")
    summary = prepare_wikitext103(
      args.data_dir,
      manual_dir=args.manual_dir or None,
      variant=args.variant,
      tokenizer=args.tokenizer or "word",
      download=args.download,
      official={"auto": None, "yes": True, "no": False}[args.official],
      progress=not args.quiet,
    )
  summary = {
    "vocab_size": summary["vocab_size"],
    "tokens": {s: summary["tokens"][s] for s in SPLITS if s in summary["tokens"]},
  }
  sys.stderr.flush()
  print(json.dumps(summary), flush=True)
  return summary


if __name__ == "__main__":
  try:
    main()
  except ValueError as e:  # bad or missing data: the message says what to do
    sys.exit(f"error: {type(e).__name__}: {e}")
