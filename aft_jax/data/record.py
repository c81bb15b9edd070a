"""What a run records of its corpus (``of_corpus``: the workdir's ``corpus.json`` and every
checkpoint's), and the one line (``DataChanged``) that says what changed since: the files
(``check_sources``), then the loaded corpus (``check_corpus``); docs/data.md, "Your own text"."""

from __future__ import annotations

from collections.abc import Mapping

from aft_jax.data.store import BUILDERS, version

_SHOWN = 3  # changes named in one line; the rest are counted
# Records that do not name their builder's version were made by ``_UNNAMED``'s version; a run
# without a record by each builder's first.
_UNNAMED = {"pydoc": 2}


def built_by(saved: Mapping | None, dataset: str) -> int:
  """The builder version that made the corpus of the record ``saved`` (None: a new run's)."""
  if saved is None:
    return version(dataset)
  return saved.get("builder_version", _UNNAMED.get(dataset, 1))


def unrecorded(results: Mapping | None, position: Mapping | None) -> dict:
  """The record of a run from before records: the tokens its results and data position read."""
  tokens = {"train": position["num_tokens"]} if position else {}
  for split, prefix in (("validation", "valid"), ("test", "test")):
    if f"{prefix}_tokens" in (results or {}):
      tokens[split] = results[f"{prefix}_tokens"]
  return {"builder_version": 1, "tokens": tokens}


class DataChanged(ValueError):
  """The data or vocabulary differs from what a run recorded (one line naming what changed)."""


def of_corpus(corpus) -> dict:
  """The record of a loaded corpus (``aft_jax.data.Corpus``)."""
  out = {
    "name": corpus.name,
    "unit": corpus.unit,
    "tokenizer": corpus.vocab.unit,
    "bos_id": int(corpus.bos_id),
    "vocab_size": int(corpus.vocab.size),
    "builder_version": corpus.builder_version,
    "tokens": {s: int(len(t)) for s, t in corpus.splits.items()},
  }
  sha256 = getattr(corpus.vocab, "sha256", None)  # bytes have no vocabulary file
  if sha256 is not None:
    out["vocab_sha256"] = sha256
  if corpus.fingerprint is not None:
    out["source_fingerprint"] = corpus.fingerprint
  if corpus.sources is not None:
    out["sources"] = {s: dict(files) for s, files in corpus.sources.items()}
  return out


def sources(cfg) -> dict | None:  # cfg: a DataConfig
  """A text corpus's ``text.source_files`` (None for the others: their builders check them)."""
  if cfg.dataset != "text":
    return None
  from aft_jax.data import text  # pylint: disable=g-import-not-at-top

  return text.source_files(cfg)


def _source_changes(saved: Mapping, now: Mapping) -> list[str]:
  """One phrase per file that changed, was deleted, added or moved to another split."""
  was = {p: (s, d) for s, files in saved.items() for p, d in files.items()}
  is_ = {p: (s, d) for s, files in now.items() for p, d in files.items()}
  found = []
  for path in sorted(set(was) | set(is_)):
    a, b = was.get(path), is_.get(path)
    if a == b:
      continue
    if b is None:
      found.append((0, f"{a[0]} file {path} was deleted (or is no longer matched)"))
    elif a is None:
      found.append((1, f"{path} was added (to the {b[0]} split)"))
    elif a[1] != b[1]:
      found.append((0, f"{a[0]} file {path} changed"))
    else:
      found.append((2, f"{path} moved from the {a[0]} split to the {b[0]} split"))
  return [phrase for _, phrase in sorted(found, key=lambda f: f[0])]


def _corpus_changes(saved: Mapping, now: Mapping) -> list[str]:
  """What differs, on the keys both records have (older records lack some)."""
  both = lambda key: key in saved and key in now and saved[key] != now[key]  # noqa: E731
  out = []
  if both("tokenizer"):
    out.append(f"the tokenizer is {now['tokenizer']!r}, was {saved['tokenizer']!r}")
  if both("vocab_size"):
    out.append(f"the vocabulary has {now['vocab_size']:,} entries, had {saved['vocab_size']:,}")
  if both("vocab_sha256") and not both("vocab_size"):
    out.append(
      f"the {now.get('tokenizer', '')} vocabulary is another one (SHA-256 "
      f"{now['vocab_sha256'][:12]}..., was {saved['vocab_sha256'][:12]}...)"
    )
  if both("sources"):
    out += _source_changes(saved["sources"], now["sources"])
  elif both("source_fingerprint"):
    out.append("the prepared corpus was made from other source files")
  if both("tokens") and not out:
    for split in sorted(set(saved["tokens"]) & set(now["tokens"])):
      a, b = saved["tokens"][split], now["tokens"][split]
      if a != b:
        out.append(f"the {split} split has {b:,} tokens, had {a:,}")
  return out


def _refuse(changes: list[str], since: str, hint: str) -> None:
  if not changes:
    return
  shown = "; ".join(changes[:_SHOWN])
  more = f"; and {len(changes) - _SHOWN} more change(s)" if len(changes) > _SHOWN else ""
  raise DataChanged(f"the data changed since {since}: {shown}{more}; {hint}")


RESUME_HINT = (
  "a run resumes only on the data it was trained on: restore the files, or use another --workdir"
)


def check_sources(saved: Mapping | None, now: Mapping | None, since: str, hint=RESUME_HINT):
  """A ``DataChanged`` where the text files ``now`` differ from the record ``saved`` (``since``)."""
  if saved is None or now is None or "sources" not in saved:
    return
  _refuse(_source_changes(saved["sources"], now), since, hint)


def check_corpus(saved: Mapping | None, now: Mapping, since: str, hint=RESUME_HINT):
  """A ``DataChanged`` where the record ``now`` (``of_corpus``) differs from ``saved`` in builder
  version, vocabulary, files or tokens per split."""
  if saved is None:
    return
  if "builder_version" in now:  # a loaded corpus's record (a vocabulary's alone has none)
    dataset = now["name"].split("-")[0]  # pydoc-byte, text-word-<key>, wikitext103-v1-word...
    was, is_, known = built_by(saved, dataset), now["builder_version"], BUILDERS[dataset]
    if was != is_:
      what = known[was - 1] if was <= len(known) else "made by a newer aft_jax"
      raise DataChanged(
        f"the corpus builder changed since {since}: the {dataset} corpus was built by version "
        f"{was} ({what}), this aft_jax builds version {is_} ({known[is_ - 1]}), from the same "
        "files; score text with aft-evaluate --text_file, or train again in another --workdir"
      )
  _refuse(_corpus_changes(saved, now), since, hint)
