"""The repository's config files, loaded by path (configs/ is not an installed package)."""

import pathlib

from k3train import config as config_lib

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"

k3_full = config_lib.load_module(CONFIG_DIR / "k3_full.py")
k3_tiny = config_lib.load_module(CONFIG_DIR / "k3_tiny.py")
k3_h200 = config_lib.load_module(CONFIG_DIR / "k3_h200.py")
