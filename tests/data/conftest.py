"""Shared setup of the data tests."""

import pytest


@pytest.fixture
def offline(monkeypatch, tmp_path):
  """Every mirror is a file:// URL of no file: a download fails at once, offline."""
  from aft_jax.data import enwik8, wikitext103

  monkeypatch.setattr(wikitext103, "MIRRORS", [f"file://{tmp_path}/no-mirror/{{filename}}"])
  monkeypatch.setattr(enwik8, "MIRRORS", [f"file://{tmp_path}/no-mirror/enwik8.zip"])
