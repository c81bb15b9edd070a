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

  ds, step = builder.as_data_source(split), 256
  with tqdm(
    total=len(ds), desc=f"{split} {unit}", unit=unit[:3], disable=not progress, file=sys.stderr
  ) as bar:
    for start in range(0, len(ds), step):
      for rec in ds.__getitems__(list(range(start, min(start + step, len(ds))))):
        yield rec[key]
      bar.update(min(step, len(ds) - start))


def _check_official(vocab_size, tokens, lines, variant, tokenizer, official) -> bool:
  """Whether the source is the real release (official None: one split has its official line
  count); a CountMismatchError where it is but lacks the published counts."""
  auto = official is None
  if auto:
    official = any(lines[s] == OFFICIAL_LINES[s] for s in SPLITS)
    if not official:
      log.warning(
        f"WikiText-103 ({variant}): no split has its official line count {OFFICIAL_LINES}; "
        "prepared as a custom corpus."
      )
  if not official:
    return False
  checks = [(f"{s}: {{:,}} lines", lines[s], OFFICIAL_LINES[s]) for s in SPLITS]
  if variant == "v1" and tokenizer == "word":
    checks.append(("vocabulary: {:,} words", vocab_size, OFFICIAL_VOCAB_SIZE))
    checks += [(f"{s}: {{:,}} tokens", tokens[s], OFFICIAL_TOKENS[s]) for s in SPLITS]
  problems = [f"{what.format(got)}, expected {want:,}" for what, got, want in checks if got != want]
  if problems:
    hint = (
      "The files have the official names and some official counts, so they look truncated or "
      "modified: restore them (or fetch the zip again), or prepare them as a custom corpus in "
      "the same layout with --official no (cfg.official = 'no')."
      if auto
      else "The source files are not the official ones or are damaged."
    )
    raise CountMismatchError(
      f"WikiText-103 ({variant}, {tokenizer}) does not match the published statistics: "
      f"{'; '.join(problems)}. {hint}"
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
  """(folder, summary) of the corpus ``cfg`` names, prepared or reused (``store.prepare``); a
  ``sources.DataError``, ``CountMismatchError`` or ``text.TextError`` for bad sources."""
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
  tfds_dir = os.path.join(data_dir, "tfds")
  downloads = os.path.join(tfds_dir, "downloads")

  def build_and_write():
    if not progress:
      tfds.disable_progress_bar()  # TFDS's own bars
    builder = sources.build(
      cls, config, data_dir=tfds_dir, manual_dir=manual_dir, download=download
    )
    store.start(out)
    key, metadata = store.FINGERPRINT_KEY, builder.info.metadata
    return {**write(builder, out, cfg, progress), **({key: metadata.get(key)} if metadata else {})}

  current = lambda: sources.current_fingerprint(cls, config, manual_dir, downloads)  # noqa: E731
  return out, store.prepare(out, os.path.basename(out), cfg.dataset, current, build_and_write)


def _write_wikitext103(builder, out, cfg, progress) -> dict:
  from aft_jax.data import text  # pylint: disable=g-import-not-at-top

  tokenizer = cfg.tokenizer
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
  official = OFFICIAL_CHOICES[cfg.official]
  real = _check_official(vocab.size, tokens, lines, variant, tokenizer, official)
  name = corpus_name(variant, tokenizer, cfg.vocab_size)
  info = {"name": name, "variant": variant, "tokenizer": tokenizer, "lines": lines}
  extra = {"bytes": num_bytes} if num_bytes else {}
  return {"vocab_size": vocab.size, "tokens": tokens, **info, **extra, "official": real, **recorded}


def _write_enwik8(builder, out, cfg, progress) -> dict:
  from aft_jax.data import enwik8  # pylint: disable=g-import-not-at-top

  official, tokens = OFFICIAL_CHOICES[cfg.official], {}
  for split in SPLITS:
    chunks = _records(builder, split, "bytes", "MiB", progress)
    tokens[split] = store.write_tokens(out, split, (np.frombuffer(c, np.uint8) for c in chunks))
  total = sum(tokens.values())
  if total != enwik8.NUM_BYTES and official:
    raise CountMismatchError(
      f"enwik8 has {total:,} bytes, not the {enwik8.NUM_BYTES:,} of the real file: it is "
      "truncated or a different file; fetch enwik8.zip again, or drop --official yes "
      "(cfg.official = 'yes') to prepare it as a custom byte corpus."
    )
  if total != enwik8.NUM_BYTES and official is None:
    log.warning(
      f"enwik8 has {total:,} bytes, not the {enwik8.NUM_BYTES:,} of the real file: prepared as a "
      f"custom byte corpus in the same layout (validation and test are N // 20 bytes: {tokens})."
    )
  real = total == enwik8.NUM_BYTES and official is not False
  return dict(vocab_size=256, tokens=tokens, name=ENWIK8_NAME, tokenizer="byte", official=real)


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
  tokens = {s: summary["tokens"][s] for s in SPLITS}
  summary = {"vocab_size": summary["vocab_size"], "tokens": tokens}
  sys.stderr.flush()
  print(json.dumps(summary), flush=True)
  return summary


def cli() -> None:
  """``main``; an error is one line on stderr, status 1; Ctrl-C one line, status 130."""
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
