import sys

import jax
import pytest

from aft_jax.trainer import train_lib


def wrap_train_step(monkeypatch, wrapper):
  """Has the training loop call ``wrapper(step, state, batch, rng)`` for the jitted ``step``."""
  init = train_lib.Trainer.__init__

  def patched(self, *args, **kwargs):
    init(self, *args, **kwargs)
    step = self.step
    self.step = lambda *a: wrapper(step, *a)

  monkeypatch.setattr(train_lib.Trainer, "__init__", patched)


class Batches:
  """Forwards a train iterator, handing out ``change(n, batch)`` for its n-th batch."""

  def __init__(self, it, change):
    self.it, self.change, self.n = it, change, 0

  def __iter__(self):
    return self

  def __next__(self):
    self.n += 1
    return self.change(self.n, next(self.it))

  def __getattr__(self, name):  # get_state, set_state, check_state, packing
    return getattr(self.it, name)


def change_batches(monkeypatch, change):
  """Has the run's train iterator hand out ``change(n, batch)`` for its n-th batch."""
  batches = train_lib.data_lib.train_iterator
  monkeypatch.setattr(
    train_lib.data_lib, "train_iterator", lambda *a, **kw: Batches(batches(*a, **kw), change)
  )


def run_train_in_process(argv, monkeypatch, capsys):
  """(exit status, stderr or the SystemExit's text) of train.py's ``run`` on argv, in-process."""
  from aft_jax.trainer import cpu_devices, train

  monkeypatch.setattr(sys, "argv", argv)
  monkeypatch.setattr(cpu_devices, "apply", lambda cfg: None)  # (this process's jax has started)
  monkeypatch.setattr(jax.config, "config_with_absl", lambda: None)
  if train.FLAGS is None:
    train._define_flags()
  monkeypatch.setattr(train, "_define_flags", lambda: None)
  train.FLAGS.unparse_flags()
  for name in [n for n in train.FLAGS if n.split(".")[0] == "config"]:  # the last run's --config
    delattr(train.FLAGS, name)
  with pytest.raises(SystemExit) as e:
    train.run()
  code = e.value.code
  return (1, code) if isinstance(code, str) else (code, capsys.readouterr().err)
