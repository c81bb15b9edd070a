"""Scores a trained run: aft-evaluate --workdir runs/x [--split test | --text_file F]

The last stdout line is one JSON object (docs/training.md, "After training")."""

from __future__ import annotations

import argparse
import math
import os

from aft_jax import tools


def parse_args(argv=None) -> argparse.Namespace:
  p = tools.parser("evaluate", __doc__)
  p.add_argument("--split", help="A split of the run's corpus: train, validation (default), test.")
  p.add_argument("--text_file", help="Score this text file (or .jsonl, .parquet) instead.")
  p.add_argument("--stride", type=int, help="Window stride (default: final_eval_stride).")
  return p.parse_args(argv)


SPLITS = ("train", "validation", "test")
SPLIT_HINT = (
  "--split scores the corpus the run was trained on: restore its files (--text_file scores "
  "any file)"
)


def read_text(path: str, data) -> str | list[str]:
  """A UTF-8 file's text, or a JSONL or Parquet file's documents as the corpus reads them."""
  from aft_jax.data import text as text_lib  # pylint: disable=g-import-not-at-top

  records = text_lib.is_records(path)
  try:
    with open(path, encoding="utf-8") as f:
      text = "" if records else f.read()
  except OSError as e:
    raise ValueError(f"--text_file {path}: {e.strerror}") from None
  except UnicodeDecodeError as e:
    raise ValueError(f"--text_file {path} is not UTF-8 text ({e.reason})") from None
  if records:
    return list(text_lib.read_documents(path, data.encoding, data.text_field))
  if not text:
    raise ValueError(f"--text_file {path} is empty: nothing to score")
  return text


def encode_text(vocab, text: str | list[str]):
  """(ids, UTF-8 bytes, words read as <unk>) of a text or documents (each then the boundary)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from aft_jax.data import text as text_lib  # pylint: disable=g-import-not-at-top
  from aft_jax.data import vocab as vocab_lib  # pylint: disable=g-import-not-at-top

  if isinstance(text, str):
    ids, num_bytes, documents = vocab.encode(text), len(text.encode("utf-8")), [text]
  else:
    chunks, num_bytes = text_lib.encode_documents(vocab, text)
    ids, documents = np.concatenate(chunks), text
  unknown = 0
  if isinstance(vocab, vocab_lib.WordVocab):
    known = set(vocab.tokens)
    unknown = sum(t not in known for doc in documents for t in vocab_lib.word_tokens(doc))
  return ids, num_bytes, unknown


def evaluate_run(
  run, *, split: str | None = None, text: str | list[str] | None = None, stride=None
) -> dict:
  """The JSON line's dict of ``run`` scored on a split (default validation) or a ``read_text``."""
  from aft_jax import data as data_lib, decode  # pylint: disable=g-import-not-at-top
  from aft_jax.data import record  # pylint: disable=g-import-not-at-top
  from aft_jax.tools import trained  # pylint: disable=g-import-not-at-top
  from aft_jax.trainer import evaluation  # pylint: disable=g-import-not-at-top

  cfg = run.config
  seq_len = cfg.train.seq_len
  whole_past = cfg.model.streams and stride is None
  # results.json's numbers were scored with the final protocol: by default, the same.
  stride = cfg.eval.final_eval_stride if stride is None else stride
  result = {"step": run.step, "unit": run.vocab.unit}
  if text is not None:
    tokens, num_bytes, unknown = encode_text(run.vocab, text)
    result.update(bytes=num_bytes)
    if run.vocab.unit == "word":
      result.update(unk_tokens=unknown)
    desc = "text"
  else:
    split = split or "validation"
    trained_on = run.record or run.corpus_info  # the checkpoint's record, else corpus.json's
    corpus = data_lib.load_corpus(cfg.data, record.built_by(trained_on, cfg.data.dataset))
    record.check_corpus(trained_on, record.of_corpus(corpus), trained.since(run.step), SPLIT_HINT)
    tokens = corpus.splits[split]
    num_bytes = (corpus.num_bytes or {}).get(split)
    result.update(split=split)
    desc = split
  if len(tokens) == 0:
    raise ValueError("nothing to score: the text has no tokens")
  if whole_past:
    chunk = min(seq_len * cfg.eval.eval_batch_size, len(tokens))
    ev = decode.score_stream(run.model, run.params, tokens, run.bos_id, chunk)
    result.update(protocol="whole_past")
  else:
    ev = run.trainer.evaluate(run.params, tokens, run.bos_id, desc, stride=stride)
    result.update(stride=stride, protocol=evaluation.eval_protocol(seq_len, stride)["name"])
  result.update(nll=ev["nll"], ppl=evaluation.perplexity(ev["nll"]), tokens=ev["tokens"])
  if run.vocab.unit == "byte":
    result["bpb"] = ev["nll"] / math.log(2)
  elif run.vocab.unit == "subword" and num_bytes:
    result["bpb"] = evaluation.bits_per_byte(ev["nll"], ev["tokens"], num_bytes)
  return result


def evaluate_main(args: argparse.Namespace) -> dict:
  from aft_jax.data import record  # pylint: disable=g-import-not-at-top
  from aft_jax.tools import trained  # pylint: disable=g-import-not-at-top

  if args.split is not None and args.text_file is not None:
    raise ValueError("give --split or --text_file, not both")
  if args.split is not None and args.split not in SPLITS:
    raise ValueError(f"--split {args.split!r} must be one of {SPLITS}")
  config = trained.run_config(args.workdir, args.step)  # before anything slow
  seq_len = config.train.seq_len
  if args.stride is not None and not 0 <= args.stride <= seq_len:
    raise ValueError(f"--stride = {args.stride} must be in [0, seq_len = {seq_len}] (0: disjoint)")
  check = None
  text = read_text(args.text_file, config.data) if args.text_file is not None else None
  if text is None:  # a split: its files must be the ones trained on, checked before any load

    def check(step, trained_on):
      now = record.sources(config.data)
      record.check_sources(trained_on, now, trained.since(step), SPLIT_HINT)

  run = trained.load_run(args.workdir, args.step, check=check, config=config)
  result = evaluate_run(run, split=args.split, text=text, stride=args.stride)
  result["workdir"] = os.path.abspath(args.workdir)
  if args.text_file is not None:
    result["text_file"] = os.path.abspath(args.text_file)
  return result


def main(argv=None) -> None:
  tools.run_command("evaluate", evaluate_main, parse_args(argv), print_json=True)


if __name__ == "__main__":
  main()
