"""Parameter count of a config (nothing is allocated).

  python -m k3train.tools.count_params --config=configs/k3_full.py [--config.model.moe.top_k=8]

prints one JSON line: total_params, active_params (per token), and each component's share.
"""

from __future__ import annotations

import json
import sys

from k3train import cli


def main(argv=None) -> int:
  args = cli.parse(argv, "python -m k3train.tools.count_params")
  if args.exit_code is not None:
    return args.exit_code
  from k3train.model import counting   # heavy import after flag parsing
  result = counting.count(args.config)
  result["config"] = args.flags["config"].config_filename
  print(json.dumps(result))
  return 0


if __name__ == "__main__":
  sys.exit(main())
