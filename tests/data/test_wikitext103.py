"""The WikiText-103 TFDS builder, built offline from fake official archives."""

import dataclasses
import os
import zipfile

import pytest

from tests.support import fake_wikitext as fw
from aft_jax.data import sources
from aft_jax.data import wikitext103 as wt

SPLITS = wt.SPLITS


@pytest.fixture(autouse=True)
def _no_network(monkeypatch, tmp_path):
  monkeypatch.setattr(wt, "MIRRORS", [f"file://{tmp_path}/no-mirror/{{filename}}"])


def _build(tmp_path, variant, manual_dir):
  return wt.build(
    variant,
    data_dir=str(tmp_path / "tfds"),
    manual_dir=manual_dir and str(manual_dir),
    download=False,
  )


def _texts(builder, split):
  ds = builder.as_data_source(split)
  return [ds[i]["text"].decode("utf-8") for i in range(len(ds))]


def _assert_nothing_built(tmp_path, variant):
  assert not (tmp_path / "tfds" / "wikitext103" / variant / "1.0.0").exists()
  assert not list((tmp_path / "tfds").rglob("*incomplete*"))


TITLES = [" = Valkyria Chronicles III = \n", " = Naïve art = \n", " = A = \n", " = x = y = \n"]
NOT_TITLES = [
  " = = Gameplay = = \n",
  " = = = Construction = = = \n",
  " = Title =\n",
  "= Title = \n",
]


@pytest.mark.parametrize("line", TITLES + NOT_TITLES + [" \n", " The score was 2 = 3 . \n"])
def test_title_lines(line):
  assert wt.is_title_line(line) is (line in TITLES)


def test_split_articles_keeps_every_byte():
  lines = [" \n", " \n", " = A = \n", " \n", " = = S = = \n", " a \n", " = B = \n", " b \n", " \n"]
  arts = list(wt.split_articles(iter(lines)))
  assert arts == [" \n \n = A = \n \n = = S = = \n a \n", " = B = \n b \n \n"]
  assert list(wt.split_articles(iter([" x \n", " y"]))) == [" x \n y"]  # no title: one article


@pytest.mark.parametrize("variant", ["v1", "raw_v1"])
@pytest.mark.parametrize("form", ["zip", "extracted"])
def test_build_one_example_per_article(tmp_path, monkeypatch, variant, form):
  manual = tmp_path / "manual"
  if form == "zip":
    fw.trust(monkeypatch, variant, fw.write_zip(str(manual), variant))
  else:
    fw.write_extracted(str(manual), variant)
  builder = _build(tmp_path, variant, manual)
  assert builder.info.disable_shuffling
  for split in SPLITS:
    arts = _texts(builder, split)
    expected = fw.split_text(split, raw=variant == "raw_v1")
    assert "".join(arts) == expected  # exact round trip, in order
    titles = fw.titles(split, raw=variant == "raw_v1")
    assert len(arts) == len(titles)
    assert arts[0].split("\n")[:2] == [" ", f" = {titles[0]} = "]  # the leading blank line too
    for art, title in zip(arts[1:], titles[1:]):
      assert art.split("\n")[0] == f" = {title} = "
    assert ("<unk>" in arts[-1] + arts[0]) == (variant == "v1")
  assert "東京" in "".join(_texts(builder, "train"))
  # Sub-sections stay inside their article.
  assert " = = = Construction = = = " in _texts(builder, "train")[1]


def test_rebuild_is_reused(tmp_path, monkeypatch):
  manual = tmp_path / "manual"
  fw.trust(monkeypatch, "v1", fw.write_zip(str(manual), "v1"))
  _build(tmp_path, "v1", manual)
  os.remove(manual / "wikitext-103-v1.zip")  # the source is no longer needed
  builder = _build(tmp_path, "v1", manual)
  assert "".join(_texts(builder, "test")) == fw.split_text("test", raw=False)


def _flip_byte_in_stored_zip(manual, needle):
  """The fake v1 zip, uncompressed (a flipped byte is a clean CRC error), one byte flipped."""
  path = fw.write_zip(str(manual), "v1")
  with zipfile.ZipFile(path) as zf:
    members = {n: zf.read(n) for n in zf.namelist()}
  with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
    for n, d in members.items():
      zf.writestr(n, d)
  data = bytearray(open(path, "rb").read())
  data[data.index(needle)] ^= 0x01
  open(path, "wb").write(bytes(data))
  return path


BAD_CASES = {
  "checksum": (sources.ChecksumError, "sha256"),
  "truncated_zip": (sources.CorruptArchiveError, "not a readable zip"),
  "bad_crc": (sources.CorruptArchiveError, "cannot be decompressed"),
  "zip_missing_split": (wt.MissingDataError, "wikitext-103/wiki.valid.tokens"),
  "dir_missing_split": (wt.MissingDataError, "wiki.test.tokens"),
  "empty_file": (wt.BadSplitFileError, "wiki.valid.tokens is empty"),
  "not_utf8": (wt.BadSplitFileError, "line 3 is not valid UTF-8"),
}


def _make_bad(case, manual, monkeypatch):
  if case == "checksum":
    fw.write_zip(str(manual), "v1")
    monkeypatch.setitem(wt.ARCHIVES, "v1", dataclasses.replace(wt.ARCHIVES["v1"], sha256="0" * 64))
  elif case == "truncated_zip":
    path = fw.write_zip(str(manual), "v1")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    fw.trust(monkeypatch, "v1", path)  # the checksum passes: the zip itself is refused
  elif case == "bad_crc":
    fw.trust(monkeypatch, "v1", _flip_byte_in_stored_zip(manual, "MacArthur".encode()))
  elif case == "zip_missing_split":
    fw.trust(monkeypatch, "v1", fw.write_zip(str(manual), "v1", skip=("validation",)))
  elif case == "dir_missing_split":
    fw.write_extracted(str(manual), "v1", skip=("test",))
  elif case == "empty_file":
    fw.write_extracted(str(manual), "v1", {"validation": b""})
  elif case == "not_utf8":
    bad = " \n = Homarus = \n caf\xe9 \n".encode("latin-1")
    fw.write_extracted(str(manual), "v1", {"validation": bad})


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_data_raises_and_leaves_nothing_built(tmp_path, monkeypatch, case):
  manual = tmp_path / "manual"
  _make_bad(case, manual, monkeypatch)
  error, message = BAD_CASES[case]
  with pytest.raises(error, match=message) as info:
    _build(tmp_path, "v1", manual)
  assert isinstance(info.value, ValueError)
  _assert_nothing_built(tmp_path, "v1")
  # Repair the data: the next run builds a complete, correct dataset.
  for p in sorted(manual.rglob("*"), reverse=True):
    p.rmdir() if p.is_dir() else p.unlink()
  fw.write_extracted(str(manual), "v1")
  builder = _build(tmp_path, "v1", manual)
  for split in SPLITS:
    assert "".join(_texts(builder, split)) == fw.split_text(split, raw=False)


def test_missing_everything_names_the_file_and_place(tmp_path):
  manual = tmp_path / "manual"
  manual.mkdir()
  with pytest.raises(wt.MissingDataError) as info:
    _build(tmp_path, "raw_v1", manual)
  msg, train = str(info.value), os.path.join(str(manual), "wikitext-103-raw", "wiki.train.raw")
  assert "wikitext-103-raw-v1.zip" in msg and str(manual) in msg and train in msg
  assert "Downloading was disabled" in msg and "--manual_dir" in msg
  with pytest.raises(wt.MissingDataError, match="downloads/manual"):  # TFDS's default manual_dir
    _build(tmp_path, "v1", None)
  _assert_nothing_built(tmp_path, "raw_v1")


def test_download_tries_mirrors_in_turn(tmp_path, monkeypatch):
  """Mirrors are file:// URLs: a missing one, a corrupt one, then a good one."""
  good = fw.write_zip(str(tmp_path / "good"), "v1")
  bad = fw.write_zip(str(tmp_path / "bad"), "v1", {"test": " = X = \n tampered \n"})
  fw.trust(monkeypatch, "v1", good)
  mirrors = [
    f"file://{d}/{{filename}}" for d in (tmp_path / "nowhere", *map(os.path.dirname, (bad, good)))
  ]
  monkeypatch.setattr(wt, "MIRRORS", mirrors)
  builder = wt.build("v1", data_dir=str(tmp_path / "tfds"), manual_dir=None, download=True)
  assert "".join(_texts(builder, "test")) == fw.split_text("test", raw=False)
  downloads = tmp_path / "tfds" / "downloads"
  assert sorted(p.name for p in downloads.iterdir() if p.is_file()) == ["wikitext-103-v1.zip"]
  assert sources.sha256_of(str(downloads / "wikitext-103-v1.zip")) == sources.sha256_of(good)
  # All mirrors failing: the error lists each attempt.
  monkeypatch.setattr(wt, "MIRRORS", [f"file://{os.path.dirname(bad)}/{{filename}}"])
  with pytest.raises(wt.MissingDataError, match="sha256") as info:
    wt.locate_source("v1", manual_dir=None, download_dir=str(tmp_path / "dl2"))
  assert "Download attempts" in str(info.value)
  assert not list((tmp_path / "dl2").iterdir())  # no partial file kept


def test_changed_source_is_built_again(tmp_path):
  """A finished build is not reused once the source files differ from the ones it read."""
  manual = tmp_path / "manual"
  fw.write_extracted(str(manual), "v1")
  _build(tmp_path, "v1", manual)
  changed = fw.split_text("test", raw=False).replace("illustrator", "painter")
  folder = fw.write_extracted(str(manual), "v1", {"test": changed})
  builder = _build(tmp_path, "v1", manual)
  assert "".join(_texts(builder, "test")) == changed
  paths = [os.path.join(folder, f"wiki.{s}.tokens") for s in ("train", "valid", "test")]
  assert builder.info.metadata["source_fingerprint"] == sources.fingerprint(paths)
