"""Text generation: prefill the prompt, then decode with the KDA state / conv cache and the MLA
latent cache (`k3train.model.decode`).

  python -m k3train.tools.generate --hf_checkpoint=DIR --prompt="def main():" \
      [--max_new_tokens=64 --temperature=0 --top_p=1.0 --batch=1 --seed=0]
  python -m k3train.tools.generate --workdir=W --prompt=... [--config=FILE]

--temperature=0 (the default) is greedy decoding; otherwise nucleus sampling with --top_p. The
prompt is repeated --batch times (one row each; rows sample independently). Prints each row's
text and the prefill and decode throughput in tokens/s, measured after a first untimed call
compiled each program. The tokenizer is --tokenizer, else the release's `tiktoken.model` when the
release directory has one, else the config's data.tokenizer.
"""

from __future__ import annotations

import os
import sys
import time

from absl import flags

from k3train import cli

PROG = "python -m k3train.tools.generate"


def _define(fv: flags.FlagValues) -> None:
  from k3train.tools.logits import define_model_source
  define_model_source(fv)
  flags.DEFINE_string("prompt", None, "the prompt text", flag_values=fv)
  flags.DEFINE_integer("max_new_tokens", 64, "tokens to generate per row", flag_values=fv)
  flags.DEFINE_float("temperature", 0.0, "0: greedy; > 0: sampling temperature", flag_values=fv)
  flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass (with --temperature > 0)", flag_values=fv)
  flags.DEFINE_integer("batch", 1, "rows decoded together (the prompt repeated)", flag_values=fv)
  flags.DEFINE_integer("seed", 0, "sampling seed", flag_values=fv)
  flags.DEFINE_string("tokenizer", None, "tokenizer (default: see --help)", flag_values=fv)


def generate(decoder, prompt_ids, *, max_new_tokens: int, temperature: float, top_p: float,
             batch: int, seed: int):
  """(generated ids [batch, max_new_tokens], timings dict). Each program runs once untimed
  first, so the timings exclude compilation."""
  import jax
  import numpy as np
  from k3train.model import decode
  tokens = np.tile(np.asarray(prompt_ids, np.int32)[None], (batch, 1))
  key = jax.random.key(seed)
  pick = jax.jit(lambda logits, k: decode.sample(logits, k, temperature=temperature, top_p=top_p))
  logits, cache = decoder.prefill(tokens)                       # compile
  jax.block_until_ready(logits)
  t0 = time.perf_counter()
  logits, cache = decoder.prefill(tokens)
  jax.block_until_ready(logits)
  t_prefill = time.perf_counter() - t0
  out = []
  key, sub = jax.random.split(key)
  nxt = pick(logits[:, -1], sub)
  out.append(nxt)
  t_decode, steps = 0.0, 0
  for i in range(max_new_tokens - 1):
    t0 = time.perf_counter()
    logits, cache = decoder.step(nxt, cache)
    key, sub = jax.random.split(key)
    nxt = pick(logits, sub)
    jax.block_until_ready(nxt)
    if i > 0:                                                  # the first step compiled
      t_decode += time.perf_counter() - t0
      steps += 1
    out.append(nxt)
  ids = np.stack([np.asarray(t) for t in out], axis=1) if out else np.zeros((batch, 0), np.int32)
  return ids, {"prefill_s": t_prefill, "prefill_tokens": tokens.size,
               "decode_s": t_decode, "decode_tokens": steps * batch}


def _tokenizer(fv, cfg):
  from k3train.data import tokenizer as tokenizer_lib
  if fv.tokenizer:
    return tokenizer_lib.load_tokenizer(fv.tokenizer)
  if fv.hf_checkpoint:
    path = os.path.join(fv.hf_checkpoint, "tiktoken.model")
    if os.path.isfile(path):
      return tokenizer_lib.load_tokenizer("tiktoken:" + path)
  return tokenizer_lib.load_tokenizer(cfg.data.tokenizer)


def main(argv=None) -> int:
  args = cli.parse(argv, PROG, define=_define, config_required=False)
  if args.exit_code is not None:
    return args.exit_code
  fv = args.flags
  from k3train.tools.logits import check_model_source
  if not check_model_source(fv, PROG):
    return cli.USAGE_ERROR
  if fv.prompt is None:
    cli.error(PROG, "--prompt is required")
    return cli.USAGE_ERROR
  for name, low in (("max_new_tokens", 1), ("batch", 1)):
    if fv[name].value < low:
      cli.error(PROG, f"--{name} must be >= {low}, got {fv[name].value}")
      return cli.USAGE_ERROR
  if fv.temperature < 0 or not 0 < fv.top_p <= 1:
    cli.error(PROG, "--temperature must be >= 0 and --top_p in (0, 1]")
    return cli.USAGE_ERROR
  from k3train.config import ConfigError
  from k3train.tools.hf import HFError
  from k3train.tools.hf_files import ReleaseError
  from k3train.tools.logits import load_model
  try:
    model, cfg = load_model(fv, args.config)
    tok = _tokenizer(fv, cfg)
  except (ConfigError, ReleaseError, HFError, ValueError, FileNotFoundError) as e:
    cli.error(PROG, str(e))
    return cli.USAGE_ERROR
  ids = tok.encode(fv.prompt)
  if not ids:
    cli.error(PROG, "--prompt encodes to no tokens")
    return cli.USAGE_ERROR
  if max(ids) >= cfg.model.vocab_size:
    cli.error(PROG, f"the tokenizer yields id {max(ids)} ≥ model.vocab_size={cfg.model.vocab_size}; "
              "pass the model's --tokenizer")
    return cli.USAGE_ERROR
  from k3train.model.decode import Decoder
  decoder = Decoder(model, max_len=len(ids) + fv.max_new_tokens)
  out, t = generate(decoder, ids, max_new_tokens=fv.max_new_tokens, temperature=fv.temperature,
                    top_p=fv.top_p, batch=fv.batch, seed=fv.seed)
  for row in out:
    print(fv.prompt + tok.decode([int(i) for i in row]))
  rate = lambda n, s: f"{n / s:,.1f}" if s > 0 else "n/a"
  print(f"prefill: {t['prefill_tokens']} tokens in {t['prefill_s']:.3f} s "
        f"({rate(t['prefill_tokens'], t['prefill_s'])} tokens/s)")
  print(f"decode: {t['decode_tokens']} tokens in {t['decode_s']:.3f} s "
        f"({rate(t['decode_tokens'], t['decode_s'])} tokens/s, batch {fv.batch})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
