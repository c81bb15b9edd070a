from aft_jax.trainer import train_lib


def wrap_train_step(monkeypatch, wrapper):
  """Has ``train_and_evaluate``'s loop call ``wrapper(step, state, batch, rng)`` instead of the
  jitted train step ``step``."""
  init = train_lib.Trainer.__init__

  def patched(self, *args, **kwargs):
    init(self, *args, **kwargs)
    step = self.step
    self.step = lambda *a: wrapper(step, *a)

  monkeypatch.setattr(train_lib.Trainer, "__init__", patched)
