"""Prepare a corpus (``aft-prepare``): download or read, build TFDS, tokenise, cache token ids.
Its last stdout line is one JSON object, {"vocab_size": V, "tokens": {"train": N, ...}}.
docs/data.md says where the data goes, how a rerun reuses it and what ``--official`` checks.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Iterator

import numpy as np

from aft_jax.ctrl_c import stops_on_ctrl_c
from aft_jax.data import pydoc, store
from aft_jax.data.config import DATASETS, OFFICIAL, TOKENIZERS, DataConfig, resolve_data_dir

log = logging.getLogger(__name__)

# Published statistics of wikitext-103-v1 under the word protocol: Merity et al. 2016, Table 1.
OFFICIAL_VOCAB_SIZE = 267_735
OFFICIAL_TOKENS = {"train": 103_227_021, "validation": 217_646, "test": 245_569}
# Lines per split file (identical in both releases); how real data is recognised.
OFFICIAL_LINES = {"train": 1_801_350, "validation": 3_760, "test": 4_358}

SPLITS = store.SPLITS
# --official / config.data.official -> the `official` argument of the prepare functions.
OFFICIAL_CHOICES = dict(zip(OFFICIAL, (None, True, False)))
ENWIK8_NAME = "enwik8-byte"


class CountMismatchError(ValueError):
  """Real WikiText-103 did not give the published counts."""


def resolve_variant(tokenizer: str, variant: str | None) -> str:
  """The release a tokenizer reads (checked by ``DataConfig``): bytes always read the raw text."""
  if tokenizer == "byte":
    if variant not in (None, "", "raw_v1"):
      log.warning("The byte tokenizer reads raw_v1, not %s.", variant)
    return "raw_v1"
  return variant or "v1"


def corpus_name(variant: str, tokenizer: str, vocab_size: int = 0) -> str:
  size = str(vocab_size) if tokenizer == "subword" else ""
  return f"wikitext103-{variant}-{tokenizer}{size}"


def _records(builder, split: str, key: str, unit: str, progress: bool) -> Iterator[bytes]:
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


def check_official(
  summary: dict, lines: dict[str, int], *, variant: str, tokenizer: str, official: bool | None
) -> bool:
  """Checks the published counts on real data; returns whether it is real (official None:
  real when one split has its official line count, which a custom corpus would not hit)."""
  is_real = any(lines[s] == OFFICIAL_LINES[s] for s in SPLITS) if official is None else official
  if not is_real:
    if official is None:
      log.warning(
        "WikiText-103 (%s): no split has its official line count %s; prepared as a custom corpus.",
        variant,
        OFFICIAL_LINES,
      )
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


def prepared_path(data_dir: str, cfg: DataConfig) -> str:
  """The store folder of the corpus ``cfg`` names (not pydoc, which is built in memory)."""
  if cfg.dataset == "text":
    from aft_jax.data import text  # pylint: disable=g-import-not-at-top

    name = text.corpus_name(cfg, text.split_files(cfg))
  elif cfg.dataset == "enwik8":
    name = ENWIK8_NAME
  else:
    variant = resolve_variant(cfg.tokenizer, cfg.variant)
    name = corpus_name(variant, cfg.tokenizer, cfg.vocab_size)
  return store.prepared_dir(data_dir, name)


def prepare_corpus(data_dir: str, cfg: DataConfig, *, download=True, progress=True):
  """Prepares (or reuses, under its lock) the corpus ``cfg`` names under ``data_dir``; returns
  (its folder, its summary). Raises ``sources.DataError`` for bad or missing source data,
  ``CountMismatchError`` for real data without the published counts, ``text.TextError``."""
  data_dir = os.path.expanduser(data_dir)
  if cfg.dataset == "text":
    from aft_jax.data import text  # pylint: disable=g-import-not-at-top

    return text.prepare_text(data_dir, cfg, progress=progress)
  # (TFDS is slow to import)
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  from aft_jax.data import enwik8, sources, wikitext103  # pylint: disable=g-import-not-at-top

  if cfg.dataset == "enwik8":
    cls, config, write = enwik8.Enwik8, "bytes", _write_enwik8
  else:
    cls, config = wikitext103.Wikitext103, resolve_variant(cfg.tokenizer, cfg.variant)
    write = _write_wikitext103
  out, manual_dir = prepared_path(data_dir, cfg), cfg.manual_dir or None
  downloads = os.path.join(data_dir, "tfds", "downloads")
  with store.lock(out, os.path.basename(out)):
    current = lambda: sources.current_fingerprint(cls, config, manual_dir, downloads)  # noqa: E731
    summary = store.reusable(out, current, store.version(cfg.dataset))
    if summary is not None:
      return out, summary
    if not progress:
      tfds.disable_progress_bar()  # TFDS's own bars
    tfds_dir = os.path.join(data_dir, "tfds")
    builder = sources.build(
      cls, config, data_dir=tfds_dir, manual_dir=manual_dir, download=download
    )
    store.start(out)
    summary = write(builder, out, cfg, progress)
    key = store.FINGERPRINT_KEY
    recorded = {key: builder.info.metadata.get(key)} if builder.info.metadata else {}
    summary.update(recorded, **{store.VERSION_KEY: store.version(cfg.dataset)})
    store.finish(out, summary)
    return out, summary


def _write_wikitext103(builder, out, cfg, progress) -> dict:
  from aft_jax.data import text  # pylint: disable=g-import-not-at-top

  tokenizer, vocab_size = cfg.tokenizer, cfg.vocab_size
  variant = resolve_variant(tokenizer, cfg.variant)
  articles = lambda split: (  # noqa: E731
    a.decode("utf-8") for a in _records(builder, split, "text", "articles", progress)
  )
  what = f"the WikiText-103 {variant} train split"
  # raw_v1 has real words where v1 has <unk>: held-out words unseen in train need one.
  vocab = text.learn_vocab(cfg, articles("train"), what, add_unk=variant == "raw_v1")
  recorded = text.save_vocab(vocab, out)
  tokens, lines, num_bytes = {}, {}, {}
  for split in SPLITS:
    if tokenizer == "subword":  # each article a document, as in a text corpus
      docs = list(articles(split))
      lines[split] = sum(a.count("\n") for a in docs)
      chunks, num_bytes[split] = text.encode_documents(vocab, docs)
    else:  # bytes as uint8 (ByteVocab.encode's uint32 would hold 4x the memory)
      encode = vocab.encode if tokenizer == "word" else lambda t: np.frombuffer(t.encode(), "u1")
      try:
        chunks = [encode(a) for a in articles(split)]
      except ValueError as e:  # a v1 held-out word missing from train: not the official data
        raise ValueError(f"{variant} {split} split: {e}; the official v1 has no such words") from e
      lines[split] = int(sum(np.count_nonzero(c == vocab.eos_id) for c in chunks))
    tokens[split] = store.write_tokens(out, split, chunks)
    del chunks
  summary = {"vocab_size": vocab.size, "tokens": tokens}
  official = OFFICIAL_CHOICES[cfg.official]
  real = check_official(summary, lines, variant=variant, tokenizer=tokenizer, official=official)
  extra = {"bytes": num_bytes} if num_bytes else {}
  name = corpus_name(variant, tokenizer, vocab_size)
  info = {"name": name, "variant": variant, "tokenizer": tokenizer, "lines": lines}
  return {**summary, **info, **extra, "official": real, **recorded}


def _write_enwik8(builder, out, cfg, progress) -> dict:
  from aft_jax.data import enwik8  # pylint: disable=g-import-not-at-top

  official = OFFICIAL_CHOICES[cfg.official]
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
  official = real and official is not False
  return {
    "vocab_size": 256,
    "tokens": tokens,
    "name": ENWIK8_NAME,
    "tokenizer": "byte",
    "official": official,
  }


def main(argv=None) -> dict:
  """Runs the CLI; returns the summary it printed."""
  p = argparse.ArgumentParser(
    prog="python -m aft_jax.data.prepare",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  add = p.add_argument
  add("--dataset", choices=DATASETS, default="wikitext103")
  add("--data_dir", default="", help="default: $AFT_JAX_DATA, else ~/.cache/aft_jax (as aft-train)")
  add("--manual_dir", default="", help="holds the official zip or its extracted files")
  add("--variant", choices=("v1", "raw_v1"), help="default v1 for words, raw_v1 for bytes")
  add("--tokenizer", choices=TOKENIZERS, help="default: word for wikitext103, byte for pydoc")
  add("--nodownload", dest="download", action="store_false", help="never use the network")
  add("--official", choices=tuple(OFFICIAL_CHOICES), default="auto", help="docs/data.md")
  add("--vocab_size", type=int, default=0, help="--tokenizer subword: the number of pieces")
  for split in ("train", "valid", "test"):
    add(f"--{split}_files", default="", help=f"--dataset text: comma-separated globs ({split})")
  add("--text_field", default="", help="--dataset text: the JSONL field / Parquet column")
  add("--quiet", action="store_true", help="no progress bars")
  args = p.parse_args(argv)
  logging.basicConfig(
    level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
  )
  # The trainer's own resolution, so that `aft-prepare` then `aft-train` meet in one folder.
  data_dir = resolve_data_dir(args.data_dir)
  names = ("vocab_size", "train_files", "valid_files", "test_files", "text_field", "manual_dir")
  given = {k: getattr(args, k) for k in names if getattr(args, k)}
  if args.dataset != "enwik8":  # (enwik8 is bytes whatever --tokenizer says)
    given["tokenizer"] = args.tokenizer or ("word" if args.dataset == "wikitext103" else "byte")
  if args.dataset == "wikitext103":
    given["variant"] = resolve_variant(given["tokenizer"], args.variant)
  config = {"dataset": args.dataset, "official": args.official, **given}
  cfg = DataConfig.of(config).validate()  # the command line's check
  if args.dataset == "pydoc":
    vocab, splits = pydoc.pydoc_splits(cfg.tokenizer)
    summary = {"vocab_size": vocab.size, "tokens": {k: int(v.size) for k, v in splits.items()}}
  else:  # (pydoc is built in memory: nothing is written)
    out, summary = prepare_corpus(data_dir, cfg, download=args.download, progress=not args.quiet)
    default = "" if args.data_dir else " (the default data_dir, which the trainer reads)"
    print(f"Prepared {os.path.basename(out)} in {out}{default}", file=sys.stderr)
  summary = {
    "vocab_size": summary["vocab_size"],
    "tokens": {s: summary["tokens"][s] for s in SPLITS if s in summary["tokens"]},
  }
  sys.stderr.flush()
  print(json.dumps(summary), flush=True)
  return summary


def cli() -> None:
  """``main`` with an error as one line on stderr and exit status 1, Ctrl-C as one line and
  status 130 (``aft_jax.ctrl_c``)."""
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
