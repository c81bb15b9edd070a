"""Small WikiText-103 look-alikes in the official layout and format: a leading ' \\n', titles
' = Title = ', sections ' = = Sub = = ', lines of one space between, `<unk>` in v1 only."""

from __future__ import annotations

import dataclasses
import os
import zipfile

from aft_jax.data import sources, wikitext103

# Each article: its title, then paragraphs, a "== " line starting a section. '{x}' is a rare word
# that v1 writes as <unk> (as it does held-out words that train lacks).
_ARTICLES = {
  "train": [
    """Valkyria Chronicles III
Senjō no {Valkyria} 3 : Unrecorded Chronicles is a tactical role @-@ playing video game .
The game began development in 2010 , carrying over a large portion of the work .
== Gameplay
As with previous games , the player controls a squad of soldiers .
Troops are divided into five classes : Scouts , Shocktroopers , Engineers .
== Reception
It sold 102 @,@ 779 copies in Japan – a {modest} result .""",
    """Tower Building of the Little Rock Arsenal
The building is located in MacArthur Park in downtown Little Rock , Arkansas .
Café Zürich and 東京 are not mentioned in the original article .
== = Construction =
The arsenal was constructed at the request of Governor {Yell} .""",
    """Cicely Mary Barker
Cicely Mary Barker was an English illustrator best known for a series of fantasy books .""",
  ],
  "validation": [
    """Homarus gammarus
Homarus gammarus is a game of the English Park series , and it sold 779 copies .
The game was known in Japan as Café Little Rock .
== Reception
It is a {modest} tactical game with five classes .""",
    """Naïve art
Naïve art is a series of books by Cicely Mary Barker .""",
  ],
  "test": [
    """Robert Boulter
Robert Boulter is an English illustrator and video game player .
He was known for the 2010 game Tower of Arkansas .
== Career
In 2010 Boulter began work on a {Herons} series .""",
  ],
}


def _fill(text: str, raw: bool) -> str:
  words = text.split(" ")
  return " ".join((w[1:-1] if raw else "<unk>") if w.startswith("{") else w for w in words)


def _text(split: str, raw: bool) -> str:
  lines = [" "]
  for article in _ARTICLES[split]:
    title, *rest = article.split("\n")
    lines += [f" = {title} = ", " "]
    for line in rest:
      heading = line.startswith("== ")
      lines += [f" = = {line[3:]} = = " if heading else f" {_fill(line, raw)} ", " "]
    lines.append(" ")
  return "\n".join(lines) + "\n"


def _v1(text: str, split: str) -> str:
  known = set(_text("train", raw=True).split()) if split != "train" else None
  out = []
  for word in text.split(" "):
    core = word.rstrip("\n")
    if known is not None and core and core not in known:
      word = "<unk>" + word[len(core) :]
    out.append(word)
  return " ".join(out)


def split_text(split: str, *, raw: bool) -> str:
  text = _text(split, raw)
  return text if raw else _v1(text, split)


def titles(split: str, *, raw: bool = True) -> list[str]:
  return [t if raw else _v1(t, split) for t in (a.split("\n")[0] for a in _ARTICLES[split])]


def texts(variant: str) -> dict[str, str]:
  return {s: split_text(s, raw=variant == "raw_v1") for s in wikitext103.SPLITS}


def _files(variant: str, contents, skip):
  """(file name, bytes) of each split not in `skip`; `contents` overrides split contents."""
  contents = {**texts(variant), **(contents or {})}
  for split in (s for s in wikitext103.SPLITS if s not in skip):
    data = contents[split]
    data = data.encode("utf-8") if isinstance(data, str) else data
    yield wikitext103.ARCHIVES[variant].split_file(split), data


def write_zip(directory: str, variant: str, contents=None, *, skip=()) -> str:
  """Writes `<directory>/<official zip name>` (as `_files`); returns its path."""
  archive = wikitext103.ARCHIVES[variant]
  path = os.path.join(directory, archive.filename)
  os.makedirs(directory, exist_ok=True)
  with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
    zf.writestr(f"{archive.folder}/", b"")
    for name, data in _files(variant, contents, skip):
      zf.writestr(f"{archive.folder}/{name}", data)
  return path


def write_extracted(directory: str, variant: str, contents=None, *, skip=()) -> str:
  """Writes `<directory>/<folder>/wiki.<split>.<ext>` (as `_files`); returns the folder."""
  folder = os.path.join(directory, wikitext103.ARCHIVES[variant].folder)
  os.makedirs(folder, exist_ok=True)
  for name, data in _files(variant, contents, skip):
    with open(os.path.join(folder, name), "wb") as f:
      f.write(data)
  return folder


def trust(monkeypatch, variant: str, path: str) -> None:
  """Records the checksum of `path` as the official one."""
  archive = dataclasses.replace(wikitext103.ARCHIVES[variant], sha256=sources.sha256_of(path))
  monkeypatch.setitem(wikitext103.ARCHIVES, variant, archive)
