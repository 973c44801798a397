"""Self-speculative decoding with the MTP module as a one-token draft (k3train/tools/generate.py,
`--speculative`): the draft's cached path equals the training path, the output equals plain
greedy decoding with document resets in the prompt, accepted and rejected drafts leave the main
and MTP caches as a token-by-token decode would (checked round by round with drafts forced right
or wrong), and the command line reports the acceptance rate and refuses what it cannot do."""

import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.model.test_decode import randomize
from tests.model.test_mtp import mtp_config
from tests.configs import quick
from k3train.model import decode
from k3train.model import mtp as mtp_lib
from k3train.model.decoder import build_model
from k3train.tools import generate

T_PROMPT, T_NEW = 21, 17


@pytest.fixture(scope="module")
def tiny():
  """The four-layer k3_tiny with an MTP module, every parameter moved off its initial value."""
  cfg = quick(mtp_config())
  return randomize(build_model(cfg.model), seed=5), cfg


def prompt(vocab):
  """Two rows of T_PROMPT tokens; row 0 holds three documents, row 1 two."""
  rng = np.random.default_rng(2)
  tokens = rng.integers(8, vocab, (2, T_PROMPT)).astype(np.int32)
  seg = np.ones((2, T_PROMPT), np.int32)
  seg[0, 6:], seg[0, 15:] = 2, 3
  seg[1, 12:] = 2
  return tokens, seg


def continued(seg, n):
  """The prompt's segment ids followed by n decoded tokens that continue each row's document."""
  return np.concatenate([seg, np.repeat(seg[:, -1:], n, axis=1)], axis=1)


def plain_greedy(model, tokens, seg, n):
  """n greedy tokens [B, n] from the cached decoder, one token per step."""
  dec = decode.Decoder(model, max_len=tokens.shape[1] + n)
  logits, cache = dec.prefill(tokens, seg)
  out = [np.argmax(np.asarray(logits[:, -1]), axis=-1).astype(np.int32)]
  for _ in range(n - 1):
    logits, cache = dec.step(out[-1], cache)
    out.append(np.argmax(np.asarray(logits), axis=-1).astype(np.int32))
  return np.stack(out, axis=1)


def training_mtp_logits(model, tokens_bt, seg_bt):
  """MTP logits [B, T - 1, V] of the training path at positions 0..T−2 (slot j predicts j + 2)."""
  fn = nnx.jit(lambda m, x, y, s: mtp_lib.mtp_logits(m, m.mtp, x, y, s, (s > 0).astype(jnp.float32)))
  return np.asarray(fn(model, tokens_bt[:, :-1], tokens_bt[:, 1:], seg_bt[:, :-1]))


def test_cached_drafts_equal_the_training_path(tiny):
  """draft_prefill + draft_step over a prompt with document resets, then a document that starts
  while drafting (row 1), give `mtp_logits` of the whole sequence (fp32: 1e-5)."""
  model, cfg = tiny
  tokens, seg = prompt(cfg.model.vocab_size)
  n = 8
  more = np.random.default_rng(3).integers(8, cfg.model.vocab_size, (2, n)).astype(np.int32)
  full, seg_full = np.concatenate([tokens, more], axis=1), continued(seg, n)
  seg_full[1, T_PROMPT + 4:] = 3
  total = full.shape[1]

  def drafts(m, x, s):
    h = m.hidden_states(x, s, (s > 0).astype(jnp.float32))
    cache = mtp_lib.draft_prefill(m, h[:, :T_PROMPT], x[:, :T_PROMPT], s[:, :T_PROMPT], max_len=total)
    out = []
    for j in range(T_PROMPT - 1, total - 1):
      logits, cache = mtp_lib.draft_step(m, h[:, j:j + 1], x[:, j + 1], s[:, j], cache)
      out.append(logits)
    return jnp.stack(out, axis=1), cache.length

  got, length = nnx.jit(drafts)(model, full, seg_full)
  want = training_mtp_logits(model, full, seg_full)[:, T_PROMPT - 1:]
  assert int(length) == total - 1
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)
  assert np.abs(want).max() > 0.1


def test_speculative_decoding_equals_plain_greedy(tiny):
  model, cfg = tiny
  tokens, seg = prompt(cfg.model.vocab_size)
  want = plain_greedy(model, tokens, seg, T_NEW)
  spec = generate.SpeculativeDecoder(model, max_len=T_PROMPT + T_NEW)
  got, stats = generate.speculative_decode(spec, tokens, seg, max_new_tokens=T_NEW)
  np.testing.assert_array_equal(got, want)
  assert T_NEW // 2 <= stats["drafts"] <= T_NEW - 1 and 0 <= stats["accepted"] <= stats["drafts"]
  assert stats["drafts"] + stats["accepted"] in (T_NEW - 1, T_NEW)  # 1 or 2 tokens per round


def test_accepted_and_rejected_drafts_keep_the_caches_exact(tiny):
  """Rounds fed a right draft (kept: the caches after both tokens) or a wrong one (rolled back
  to the caches after the first token), in a fixed pattern: every kept token is plain greedy
  decoding's, and every draft the MTP cache produces afterwards is the training path's."""
  model, cfg = tiny
  vocab = cfg.model.vocab_size
  tokens, seg = prompt(vocab)
  plain = plain_greedy(model, tokens, seg, T_NEW)
  spec = generate.SpeculativeDecoder(model, max_len=T_PROMPT + T_NEW)
  x, draft, cache, mcache = spec.prefill(tokens, seg)
  drafts = {T_PROMPT - 1: np.asarray(draft)}     # MTP slot j → its draft of position j + 2
  out, m = [np.asarray(x)], T_PROMPT             # out[k]: the token at position T_PROMPT + k
  for accept in (True, False, True, True, False, False, True):
    right = plain[:, len(out)]                   # greedy token at position m + 1
    fed = right if accept else (right + 1) % vocab
    ok, x, draft, cache, mcache = spec.round(out[-1], fed, cache, mcache)
    assert bool(ok) == accept
    if accept:
      out.append(fed)
    m += 2 if accept else 1
    drafts[m - 1] = np.asarray(draft)
    out.append(np.asarray(x))
  ids = np.stack(out, axis=1)
  np.testing.assert_array_equal(ids, plain[:, :ids.shape[1]])
  assert int(cache.length) == m and int(mcache.length) == m
  full = np.concatenate([tokens, ids], axis=1)
  mtp_logits = training_mtp_logits(model, full, continued(seg, ids.shape[1]))
  for slot, d in drafts.items():
    np.testing.assert_array_equal(d, np.argmax(mtp_logits[:, slot], axis=-1), err_msg=str(slot))


def save_workdir(model, cfg, workdir):
  """A run directory holding `model` as its checkpoint at step 1 (what generate --workdir reads)."""
  from k3train.optim.optimizer import make_optimizer
  from k3train.train import layout as layout_lib
  from k3train.train.checkpoint import Checkpointer
  optimizer = make_optimizer(cfg, nnx.state(model, nnx.Param))
  _, state, _ = layout_lib.init_sharded_state(model, optimizer, layout_lib.make_layout(cfg))
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), cfg)
  ckpt.save(1, state, {"source": "tests/tools/test_generate.py"}, force=True)
  ckpt.close()


def test_command_line_reports_acceptance_and_matches_greedy(tiny, tmp_path, capsys):
  model, cfg = tiny
  save_workdir(model, cfg, tmp_path)
  argv = ["generate", f"--workdir={tmp_path}", "--prompt=def main():", "--max_new_tokens=16"]
  assert generate.main(argv) == 0
  plain = capsys.readouterr().out.splitlines()
  assert generate.main(argv + ["--speculative"]) == 0
  spec = capsys.readouterr().out.splitlines()
  assert spec[0] == plain[0]                                      # the same text
  assert spec[-3].startswith("prefill: ") and spec[-2].startswith("decode: ")
  assert "tokens/s" in spec[-2]
  assert spec[-1].startswith("speculative: ") and "drafts accepted (" in spec[-1]


def test_command_line_refuses_what_it_cannot_do(tmp_path, capsys):
  cfg = mtp_config()
  cfg.model.mtp.enabled = False
  save_workdir(build_model(cfg.model), cfg, tmp_path)
  base = ["generate", f"--workdir={tmp_path}", "--prompt=def", "--speculative"]
  for argv, message in ((base + ["--temperature=0.7"], "--speculative decodes greedily"),
                        (base, "--speculative needs an MTP module")):
    assert generate.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
