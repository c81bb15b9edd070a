"""Your own text files as a corpus (``config.data.dataset = 'text'``): each split's files, their
documents (plain, JSONL, Parquet) and their preparation (docs/data.md, "Your own text")."""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
import sys
import zlib
from collections.abc import Iterator

import numpy as np

from aft_jax.data import store, subword
from aft_jax.data import vocab as vocab_lib
from aft_jax.data.config import DataConfig

SPLITS = store.SPLITS
_KEYS = {"train": "train_files", "validation": "valid_files", "test": "test_files"}


class TextError(ValueError):
  """A text corpus's files or settings cannot give a corpus (one line, naming the file or key)."""


def expand(spec: str, key: str) -> list[str]:
  """The files of a comma-separated list of globs (absolute paths, each glob's sorted), each real
  file once; a glob that matches no file is a TextError naming ``key`` and the glob."""
  out, seen = [], set()
  for pattern in [p.strip() for p in spec.split(",") if p.strip()]:
    matches = sorted(
      os.path.abspath(p) for p in _glob(os.path.expanduser(pattern)) if os.path.isfile(p)
    )
    if not matches:
      raise TextError(f"config.data.{key}: {pattern!r} matches no file")
    for path in matches:
      real = os.path.realpath(path)
      if real not in seen:
        seen.add(real)
        out.append(path)
  return out


def _glob(pattern: str) -> Iterator[str]:
  """A recursive glob whose ``**`` follows no folder link (a loop would repeat every file)."""
  parts = pattern.split(os.sep)
  if "**" not in parts:
    yield from glob.glob(pattern)
    return
  i = parts.index("**")
  rest = parts[i + 1 :]
  head = os.sep.join(parts[:i]) or (os.sep if i else os.curdir)  # "/**/x" or "**/x"
  for base in filter(os.path.isdir, glob.glob(head)):
    for folder, subfolders, names in os.walk(base):
      subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
      if rest:
        yield from _glob(os.path.join(glob.escape(folder), *rest))
      else:  # "dir/**": everything below
        yield from (os.path.join(folder, n) for n in names if not n.startswith("."))


def split_files(cfg: DataConfig) -> dict[str, list[str]]:
  """{split: its files}: the globs of each split, or held-out documents of the train files."""
  files = {s: expand(getattr(cfg, _KEYS[s]), _KEYS[s]) for s in SPLITS}
  missing = [s for s in ("validation", "test") if not files[s]]
  if missing:
    # Held out by the hash of each path below the files' common folder: the same on any machine.
    paths = files["train"]
    root = os.path.commonpath(paths) if len(paths) > 1 else os.path.dirname(paths[0])
    docs = sorted(
      paths, key=lambda p: hashlib.sha256(os.path.relpath(p, root).encode()).hexdigest()
    )
    fraction = {"validation": cfg.valid_fraction, "test": cfg.test_fraction}
    take = {s: max(1, round(fraction[s] * len(docs))) for s in missing}
    if len(docs) - sum(take.values()) < 1:
      raise TextError(
        f"config.data.train_files matches {len(docs)} file(s): holding out "
        f"{' and '.join(f'{take[s]} for {s}' for s in missing)} leaves none to train on; give "
        "more files, or config.data.valid_files / test_files"
      )
    for s in missing:
      files[s], docs = sorted(docs[: take[s]]), docs[take[s] :]
    files["train"] = sorted(docs)
  _refuse_shared(files, "train", ("validation", "test"), "held-out text must not be trained on")
  _refuse_shared(files, "validation", ("test",), "a file scores one held-out split")
  return files


def _refuse_shared(files: dict[str, list[str]], split: str, others, why: str) -> None:
  real = {os.path.realpath(p) for s in others for p in files[s]}
  shared = [p for p in files[split] if os.path.realpath(p) in real]
  if shared:
    first = os.path.realpath(shared[0])
    where = " and ".join(
      f"config.data.{_KEYS[s]}" for s in others if first in map(os.path.realpath, files[s])
    )
    raise TextError(
      f"{shared[0]} is in config.data.{_KEYS[split]} and in {where} "
      f"({len(shared)} such file(s)): {why}"
    )


JSONL = (".jsonl", ".jsonl.gz")
PARQUET = (".parquet",)


def is_records(path: str) -> bool:
  """Whether ``path`` holds records (JSONL or Parquet, by its ending), not one plain document."""
  return path.lower().endswith(JSONL + PARQUET)


def read_documents(path: str, encoding: str = "utf-8", text_field: str = "text") -> Iterator[str]:
  """One file's documents: a plain file's text, or each JSONL line's / Parquet row's field."""
  lower = path.lower()
  if lower.endswith(JSONL):
    yield from _jsonl(path, encoding, text_field)
    return
  if lower.endswith(PARQUET):
    yield from _parquet(path, text_field)
    return
  try:
    with open(path, "rb") as f:
      text = f.read().decode(encoding)
  except OSError as e:
    raise TextError(f"{path} cannot be read: {e.strerror}") from None
  except UnicodeDecodeError as e:
    raise TextError(
      f"{path} is not {encoding} text (byte {e.start:,}: {e.reason}): set config.data.encoding "
      "to its encoding, or leave the file out"
    ) from None
  if "\0" in text:
    raise TextError(f"{path} is not text (it holds NUL bytes): leave it out of the globs")
  if not text.strip():
    raise TextError(f"{path} is empty (no text): leave it out of the globs")
  yield text


def _one_line(e: BaseException) -> str:
  return " ".join(str(e).split()) or type(e).__name__


def _json_kind(value) -> str:
  if value is None or isinstance(value, bool):  # JSON's words: null, not None
    return f"JSON {json.dumps(value)}"
  kinds = {dict: "a JSON object", list: "a JSON array", str: "a JSON string"}
  return kinds.get(type(value), "a JSON number")


def _check_text(value: str, what: str) -> None:
  """A TextError naming ``what`` for a NUL or a lone surrogate (JSON escapes one, UTF-8 can't)."""
  if "\0" in value:
    raise TextError(f"{what} holds a NUL character (\\u0000): not text")
  try:
    value.encode("utf-8")
  except UnicodeEncodeError as e:
    code = f"\\u{ord(value[e.start]):04x}"
    raise TextError(
      f"{what} holds a lone surrogate ({code} at character {e.start:,}): not text in any "
      "encoding (a surrogate pair's other half is missing)"
    ) from None


def _jsonl(path: str, encoding: str, field: str) -> Iterator[str]:
  opener = gzip.open if path.lower().endswith(".gz") else open
  count = 0
  try:
    with opener(path, "rb") as f:
      for number, raw in enumerate(f, 1):
        if not raw.strip():
          continue
        where = f"{path} line {number}"
        try:
          record = json.loads(raw.decode(encoding))
        except UnicodeDecodeError as e:
          raise TextError(f"{where} is not {encoding} text ({e.reason})") from None
        except json.JSONDecodeError as e:
          why = e.msg.removesuffix(" at")  # ("Invalid control character at": a column follows)
          raise TextError(f"{where} is not JSON ({why}, column {e.colno})") from None
        if not isinstance(record, dict):
          raise TextError(f"{where} is {_json_kind(record)}, not an object")
        if field not in record:
          has = ", ".join(map(repr, list(record)[:8])) or "none"
          raise TextError(
            f"{where} has no field {field!r} (config.data.text_field); its fields: {has}"
          )
        value = record[field]
        if not isinstance(value, str):
          raise TextError(f"{where}: field {field!r} is {_json_kind(value)}, not a string")
        _check_text(value, f"{where}: field {field!r}")
        count += 1
        yield value
  except (OSError, EOFError, zlib.error) as e:  # gzip: damaged or cut short
    raise TextError(
      f"{path} cannot be read ({_one_line(e)}): a damaged or truncated file"
    ) from None
  if not count:
    raise TextError(f"{path} holds no records (no non-blank line): leave it out of the globs")


def _parquet(path: str, field: str) -> Iterator[str]:
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

  try:
    pf = pq.ParquetFile(path)
  except (pa.ArrowException, OSError) as e:
    raise TextError(f"{path} is not a readable Parquet file ({_one_line(e)})") from None
  schema = pf.schema_arrow
  if field not in schema.names:
    has = ", ".join(map(repr, schema.names[:8])) or "none"
    raise TextError(f"{path} has no column {field!r} (config.data.text_field); its columns: {has}")
  kind = schema.field(field).type
  # A dictionary-encoded column of strings (pandas' category) reads as its strings.
  values = kind.value_type if pa.types.is_dictionary(kind) else kind
  strings = ("is_string", "is_large_string", "is_string_view")  # (string_view: newer pyarrow)
  if not any(getattr(pa.types, test, lambda _: False)(values) for test in strings):
    raise TextError(f"{path}: column {field!r} holds {kind}, not strings")
  count = 0
  for group in range(pf.num_row_groups):
    try:
      column = pf.read_row_group(group, columns=[field]).column(0)
    except (pa.ArrowException, OSError) as e:
      raise TextError(f"{path} row group {group} cannot be read ({_one_line(e)})") from None
    if column.null_count:
      row = column.is_null().to_pylist().index(True)
      raise TextError(f"{path} row group {group} row {row}: {field!r} is null, not a string")
    for row, value in enumerate(column.to_pylist()):
      _check_text(value, f"{path} row group {group} row {row}: {field!r}")
      count += 1
      yield value
  if not count:
    raise TextError(f"{path} holds no rows: leave it out of the globs")


def corpus_name(cfg: DataConfig, files: dict[str, list[str]]) -> str:
  """The store folder's name: the tokenizer and a key of the files and settings."""
  settings = {
    "files": files,
    "tokenizer": cfg.tokenizer,
    "vocab_size": cfg.vocab_size if cfg.tokenizer == "subword" else 0,
    "encoding": cfg.encoding,
  }
  if any(is_records(p) for paths in files.values() for p in paths):
    settings["text_field"] = cfg.text_field  # (only then: plain files keep their names)
  key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
  size = str(cfg.vocab_size) if cfg.tokenizer == "subword" else ""
  return f"text-{cfg.tokenizer}{size}-{key}"


def _fingerprint(files: dict[str, list[str]]) -> str:
  h = hashlib.sha256()
  for split in SPLITS:
    h.update(f"{split}\0{store.fingerprint(files[split])}\0".encode())
  return "text:" + h.hexdigest()


def source_files(cfg: DataConfig) -> dict[str, dict[str, str]]:
  """{split: {file: ``store.file_digest``}} of the files ``cfg`` names now (writes nothing)."""
  files = split_files(cfg)
  return {s: {path: store.file_digest(path) for path in files[s]} for s in SPLITS}


def learn_vocab(cfg: DataConfig, documents, what: str = "", add_unk=True) -> vocab_lib.Vocab:
  """The vocabulary of ``cfg.tokenizer`` learned on ``documents``, the train split (``what``)."""
  if cfg.tokenizer == "byte":
    return vocab_lib.ByteVocab()
  if cfg.tokenizer == "word":
    return vocab_lib.WordVocab.build(vocab_lib.count_words(documents), add_unk=add_unk)
  what = what or "the train split (config.data.train_files)"
  return subword.train(documents, cfg.vocab_size, what=what)


def save_vocab(vocab: vocab_lib.Vocab, path: str) -> dict:
  """Writes ``vocab`` into the prepared folder ``path``; returns what summary.json records."""
  if isinstance(vocab, vocab_lib.WordVocab):
    vocab.save(os.path.join(path, vocab_lib.VOCAB_FILENAME))
  if isinstance(vocab, subword.SubwordVocab):
    vocab.save(os.path.join(path, subword.MODEL_FILENAME))
    return {"subword_sha256": vocab.sha256}
  return {}


def encode_documents(vocab: vocab_lib.Vocab, documents) -> tuple[list[np.ndarray], int]:
  """(token chunks: each document then ``eos_id``, their UTF-8 bytes plus one per boundary)."""
  chunks, num_bytes = [], 0
  boundary = np.asarray([vocab.eos_id], np.uint32)
  for doc in documents:
    chunks += [vocab.encode(doc), boundary]
    num_bytes += len(doc.encode("utf-8")) + 1
  return chunks, num_bytes


# summary.json's mark of a corpus that kept each split's document ends, `<split>-documents.npy`:
# uint32[documents], the offset past each document's boundary.
DOCUMENTS_KEY = "document_ends"


def prepare_text(data_dir: str, cfg: DataConfig, *, progress: bool = True) -> tuple[str, dict]:
  """(folder, summary) of the text corpus ``cfg`` names, prepared or reused (``store.prepare``)."""
  files = split_files(cfg)
  out = store.prepared_dir(data_dir, corpus_name(cfg, files))
  what = f"the text corpus {os.path.basename(out)}"
  write = lambda: _write(out, cfg, files, progress)  # noqa: E731
  fingerprint = lambda: _fingerprint(files)  # noqa: E731
  # (DOCUMENTS_KEY: packing needs the document ends, which older corpora lack)
  return out, store.prepare(out, what, "text", fingerprint, write, needs=DOCUMENTS_KEY)


def _write(out: str, cfg: DataConfig, files: dict[str, list[str]], progress: bool) -> dict:
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top

  store.start(out)

  def read(split):
    bar = tqdm(files[split], f"{split} files", unit="file", disable=not progress, file=sys.stderr)
    return (doc for path in bar for doc in read_documents(path, cfg.encoding, cfg.text_field))

  vocab = learn_vocab(cfg, read("train"))
  recorded = save_vocab(vocab, out)
  tokens, num_bytes, documents = {}, {}, {}
  for split in SPLITS:
    chunks, num_bytes[split] = encode_documents(vocab, read(split))
    tokens[split] = store.write_tokens(out, split, chunks)
    # chunks alternate document, boundary: a document ends after its boundary.
    ends = np.cumsum([c.size for c in chunks], dtype=np.int64)[1::2]
    if ends.size and ends[-1] >= 2**32:  # the store keeps offsets as uint32
      raise TextError(
        f"the {split} split has {ends[-1]:,} tokens, more than the 2**32 a prepared text "
        "corpus can index: split the files into several corpora"
      )
    documents[split] = store.write_tokens(out, f"{split}-documents", [ends])
  return {
    "name": os.path.basename(out),
    "tokenizer": cfg.tokenizer,
    "vocab_size": vocab.size,
    "tokens": tokens,
    "bytes": num_bytes,
    "documents": documents,
    DOCUMENTS_KEY: True,
    store.FINGERPRINT_KEY: _fingerprint(files),
    **recorded,
  }
