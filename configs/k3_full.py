"""The released Kimi K3 text model with the default recipe (every number: k3train/defaults.py)."""

from k3train import defaults


def get_config():
  return defaults.k3_full()
