"""Small enwik8 look-alikes (a MediaWiki dump's tags, markup, multi-byte UTF-8), zipped or not."""

from __future__ import annotations

import os
import zipfile

_PAGE = (
  "  <page>\n    <title>Tower Building of the Little Rock Arsenal</title>\n"
  "    <revision>\n      <text xml:space=\"preserve\">'''Café Zürich''' is in [[東京]] "
  "&amp; [[Little Rock, Arkansas|Little Rock]].\n== Construction ==\n"
  "{{Infobox building}} The arsenal was built in 1840.</text>\n    </revision>\n  </page>\n"
)


def content(num_bytes: int) -> bytes:
  """`num_bytes` bytes of a fake dump (may end inside a multi-byte character, as a cut does)."""
  header = b'<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.3/">\n'
  page = _PAGE.encode("utf-8")
  return (header + page * (num_bytes // len(page) + 1))[:num_bytes]


def write_zip(directory: str, data: bytes) -> str:
  """Writes `<directory>/enwik8.zip` holding `data` as `enwik8`; returns its path."""
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, "enwik8.zip")
  with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
    zf.writestr("enwik8", data)
  return path


def write_file(directory: str, data: bytes) -> str:
  """Writes the unzipped `<directory>/enwik8`; returns its path."""
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, "enwik8")
  with open(path, "wb") as f:
    f.write(data)
  return path
