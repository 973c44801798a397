"""Text generation: prefill the prompt, then decode with the KDA state / conv cache and the MLA
latent cache (`k3train.model.decode`).

  python -m k3train.tools.generate --hf_checkpoint=DIR --prompt="def main():" \
      [--max_new_tokens=64 --temperature=0 --top_p=1.0 --batch=1 --seed=0]
  python -m k3train.tools.generate --workdir=W --prompt=... [--config=FILE]
  python -m k3train.tools.generate --workdir=W --prompt=... --speculative

--temperature=0 (the default) is greedy decoding; otherwise nucleus sampling with --top_p. The
prompt is repeated --batch times (one row each; rows sample independently). Prints each row's
text and the prefill and decode throughput in tokens/s, measured after a first untimed call
compiled each program. The tokenizer is --tokenizer, else the release's `tiktoken.model` when the
release directory has one, else the config's data.tokenizer.

--speculative (greedy only) decodes self-speculatively with the model's MTP module
(k3train/model/mtp.py) as a one-token draft: each round feeds the next token and the MTP's draft
of the token after it, and keeps the draft when it equals the main model's greedy choice, so the
output equals plain greedy decoding. The rows of --batch advance together: a round keeps its
draft only when every row's draft is right. It also prints the share of accepted drafts. The
two tokens of a round run as two decode steps inside one compiled program (the decode step takes
one token per row), so the gain is one dispatch and one host round trip per accepted draft.
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
  flags.DEFINE_boolean("speculative", False, "greedy self-speculative decoding with the MTP "
                       "module as a one-token draft", flag_values=fv)


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


# ----------------------------------------------------------------------------- speculative


class _HiddenTap:
  """A K3Model as `decode.prefill` / `decode.decode_step` see it, keeping the hidden state h
  [B, T, d] that their output head hands to the final norm (the MTP module reads h; the decode
  functions return logits only)."""

  def __init__(self, model):
    self._model = model
    self.hidden = None

  def __getattr__(self, name):
    return getattr(self._model, name)

  def final_norm(self, h_btd):
    self.hidden = h_btd
    return self._model.final_norm(h_btd)


def _greedy(logits_bv):
  import jax.numpy as jnp
  return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)


def _spec_prefill(graphdef, state, tokens_bt, segment_ids_bt, *, max_len):
  """Prompt → (first new token x [B], the MTP draft of the token after it [B], the main cache,
  the MTP cache)."""
  from flax import nnx
  from k3train.model import decode, mtp as mtp_lib
  model = nnx.merge(graphdef, state)
  tap = _HiddenTap(model)
  logits, cache = decode.prefill(tap, tokens_bt, segment_ids_bt, max_len=max_len)
  x = _greedy(logits[:, -1])
  mcache = mtp_lib.draft_prefill(model, tap.hidden, tokens_bt, segment_ids_bt, max_len=max_len)
  draft, mcache = mtp_lib.draft_step(model, tap.hidden[:, -1:], x, cache.last_segment, mcache)
  return x, _greedy(draft), cache, mcache


def _spec_round(graphdef, state, x_b, draft_b, cache, mcache):
  """One round from position m (x) and the draft for m + 1: decode both, then keep the draft
  when it is the greedy choice after x (the caches after both tokens), else roll back to the
  caches after x. Returns (accepted, next x, its draft, cache, MTP cache)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from k3train.model import decode, mtp as mtp_lib
  model = nnx.merge(graphdef, state)
  tap = _HiddenTap(model)
  seg = cache.last_segment
  logits, cache1 = decode.decode_step(tap, x_b, cache)
  g1, h1 = _greedy(logits), tap.hidden                             # main choice at m + 1
  logits, cache2 = decode.decode_step(tap, draft_b, cache1)
  g2, h2 = _greedy(logits), tap.hidden                             # ... at m + 2, after the draft
  d1, mcache1 = mtp_lib.draft_step(model, h1, g1, seg, mcache)      # MTP slot m: drafts m + 2
  d2, mcache2 = mtp_lib.draft_step(model, h2, g2, seg, mcache1)     # MTP slot m + 1: drafts m + 3
  accepted = jnp.all(draft_b == g1)
  keep = lambda a, b: jax.tree.map(lambda u, v: jnp.where(accepted, u, v), a, b)
  return (accepted, *keep((g2, _greedy(d2), cache2, mcache2), (g1, _greedy(d1), cache1, mcache1)))


class SpeculativeDecoder:
  """Greedy self-speculative decoding with the model's MTP module as a one-token draft; `prefill`
  and `round` are jitted once per shape (the model's state is an argument)."""

  def __init__(self, model, *, max_len: int):
    import functools
    import jax
    from flax import nnx
    if getattr(model, "mtp", None) is None:
      raise ValueError("speculative decoding needs the model's MTP module (model.mtp.enabled)")
    self.max_len = int(max_len)
    self.graphdef, self.state = nnx.split(model)
    self._prefill = jax.jit(functools.partial(_spec_prefill, self.graphdef, max_len=self.max_len))
    self._round = jax.jit(functools.partial(_spec_round, self.graphdef))

  def prefill(self, tokens_bt, segment_ids_bt=None):
    """(x, draft, cache, MTP cache) after a prompt [B, T]."""
    from k3train.model.decode import prompt_arrays
    return self._prefill(self.state, *prompt_arrays(tokens_bt, segment_ids_bt, self.max_len))

  def round(self, x_b, draft_b, cache, mcache):
    """(accepted, next x, its draft, cache, MTP cache); needs two free cache slots."""
    if int(cache.length) + 2 > self.max_len:
      raise ValueError(f"the decode cache is full ({self.max_len} tokens); use a larger max_len")
    return self._round(self.state, x_b, draft_b, cache, mcache)


def speculative_decode(decoder: SpeculativeDecoder, tokens_bt, segment_ids_bt=None, *,
                       max_new_tokens: int):
  """(generated ids [B, max_new_tokens], timings dict with "drafts" and "accepted"). The cache
  needs max_len ≥ prompt + max_new_tokens. The first call of each program is untimed."""
  import jax
  import numpy as np
  decoder.prefill(tokens_bt, segment_ids_bt)[0].block_until_ready()            # compile
  t0 = time.perf_counter()
  x, draft, cache, mcache = decoder.prefill(tokens_bt, segment_ids_bt)
  jax.block_until_ready(x)
  t_prefill = time.perf_counter() - t0
  out, drafts, accepted, t_decode, timed = [], 0, 0, 0.0, 0
  while True:
    out.append(x)
    if len(out) == max_new_tokens:
      break
    t0 = time.perf_counter()
    ok, next_x, next_draft, cache, mcache = decoder.round(x, draft, cache, mcache)
    ok = bool(ok)
    if drafts > 0:                                             # the first round compiled
      t_decode += time.perf_counter() - t0
      timed += 1 + ok
    drafts, accepted = drafts + 1, accepted + ok
    if ok:
      out.append(draft)
      if len(out) == max_new_tokens:
        break
    x, draft = next_x, next_draft
  ids = np.stack([np.asarray(t) for t in out], axis=1)
  rows = ids.shape[0]
  return ids, {"prefill_s": t_prefill, "prefill_tokens": int(np.size(tokens_bt)),
               "decode_s": t_decode, "decode_tokens": timed * rows,
               "drafts": drafts, "accepted": accepted}


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
  if fv.speculative and fv.temperature > 0:
    cli.error(PROG, "--speculative decodes greedily; use --temperature=0")
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
  if fv.speculative and getattr(model, "mtp", None) is None:
    cli.error(PROG, "--speculative needs an MTP module, and this checkpoint has none "
              "(model.mtp.enabled is false)")
    return cli.USAGE_ERROR
  max_len = len(ids) + fv.max_new_tokens
  if fv.speculative:
    import numpy as np
    tokens = np.tile(np.asarray(ids, np.int32)[None], (fv.batch, 1))
    out, t = speculative_decode(SpeculativeDecoder(model, max_len=max_len), tokens,
                                max_new_tokens=fv.max_new_tokens)
  else:
    from k3train.model.decode import Decoder
    out, t = generate(Decoder(model, max_len=max_len), ids, max_new_tokens=fv.max_new_tokens,
                      temperature=fv.temperature, top_p=fv.top_p, batch=fv.batch, seed=fv.seed)
  for row in out:
    print(fv.prompt + tok.decode([int(i) for i in row]))
  rate = lambda n, s: f"{n / s:,.1f}" if s > 0 else "n/a"
  print(f"prefill: {t['prefill_tokens']} tokens in {t['prefill_s']:.3f} s "
        f"({rate(t['prefill_tokens'], t['prefill_s'])} tokens/s)")
  print(f"decode: {t['decode_tokens']} tokens in {t['decode_s']:.3f} s "
        f"({rate(t['decode_tokens'], t['decode_s'])} tokens/s, batch {fv.batch})")
  if fv.speculative:
    share = f"{100 * t['accepted'] / t['drafts']:.1f}%" if t["drafts"] else "n/a"
    print(f"speculative: {t['accepted']} of {t['drafts']} drafts accepted ({share})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
