"""The trainer's side: per-token log-probs of whole sequences in one forward, padded or packed
(docs/sampling.md), and the host helpers that lay sequences out for it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxdet
from jaxdet._src.sampling import sampling_math


def trainer_log_probs(model, tokens, *, segment_ids=None, temperature=None, invariant: bool = False):
    """``out[b, t] = log p(tokens[b, t] | the tokens before it in its sequence)``, float32 [B, T],
    from one forward ``model(tokens, segment_ids=segment_ids)``; 0 at each sequence's first token
    (a row's first column, and with `segment_ids` wherever the id changes).

    tokens: int [B, T], sequences padded at the end (padded entries are to be masked by the caller)
    or packed with `segment_ids` int [B, T]. temperature: None (the logits as they are), a float, or
    a concrete array broadcastable to [B, T] (per row or per token; 0 means greedy: the logits as
    they are); the logits are scaled as the sampler scales them, so these are the sampler's
    log-probs bit for bit. Differentiable in the model's parameters (reverse mode).
    invariant: run the forward under `jaxdet.invariant` (a model written in plain JAX or with
    flax's own modules)."""
    if not hasattr(tokens, "shape") or len(tokens.shape) != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"tokens must be an integer array [batch, seq], got {getattr(tokens, 'dtype', type(tokens))}")
    b, t = tokens.shape
    if t < 2:
        raise ValueError(f"tokens must hold at least 2 positions to score a next token, got {t}")
    if segment_ids is not None and tuple(segment_ids.shape) != (b, t):
        raise ValueError(f"segment_ids must have tokens' shape {(b, t)}, got {tuple(segment_ids.shape)}")
    inv = sampling_math.inverse_temperature(1.0 if temperature is None else temperature)
    try:
        inv = np.broadcast_to(inv, (b, t))
    except ValueError:
        raise ValueError(f"temperature must broadcast to tokens' shape {(b, t)}, got shape {inv.shape}") from None

    def forward(model, tokens, segment_ids):
        return model(tokens, segment_ids=segment_ids)

    if invariant:
        forward = jaxdet.invariant(forward)
    logits = forward(model, tokens, segment_ids)
    # The logits at position p score token p + 1, scaled as the sampler scales its row; the last
    # position scores no token (label 0, its column dropped), so the logits are never sliced.
    # Where every inverse temperature is 1 the scaled row float32(x) * 1 is x widened exactly, and
    # label_log_probs widens its input exactly before any arithmetic (docs/softmax.md), so the
    # logits go in as they are: the same bits without a [B, T, V] float32 copy.
    labels = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))
    if np.all(inv == 1) and logits.dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        scaled = logits
    else:
        inv_of_position = np.pad(inv[:, 1:], ((0, 0), (0, 1)), constant_values=1)
        scaled = sampling_math.scaled_logits(logits, jnp.asarray(inv_of_position[:, :, None]))
    log_probs = sampling_math.token_log_probs(scaled, labels)[:, :-1]
    if segment_ids is not None:
        log_probs = jnp.where(segment_ids[:, 1:] == segment_ids[:, :-1], log_probs, 0.0)
    return jnp.concatenate([jnp.zeros((b, 1), jnp.float32), log_probs], axis=1)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each sequence lies in a [rows, length] batch: row, start, length (NumPy int arrays,
    one entry per sequence), with the tokens and (packed) segment ids to feed the trainer."""

    tokens: np.ndarray
    segment_ids: np.ndarray | None
    row: np.ndarray
    start: np.ndarray
    length: np.ndarray

    def gather(self, values) -> list[np.ndarray]:
        """Per sequence, its entries of a [rows, length] array (e.g. trainer_log_probs)."""
        values = np.asarray(values)
        return [values[r, s : s + n] for r, s, n in zip(self.row, self.start, self.length)]

    def mask(self, begin: Sequence[int] | None = None) -> np.ndarray:
        """bool [rows, length]: True on each sequence's entries from `begin[i]` (e.g. its prompt's
        length: its completion) to its end; every entry when `begin` is None."""
        out = np.zeros(self.tokens.shape, bool)
        begin = np.zeros(len(self.row), int) if begin is None else np.asarray(begin)
        for r, s, n, k in zip(self.row, self.start, self.length, begin):
            out[r, s + k : s + n] = True
        return out


def _as_sequences(sequences):
    seqs = [np.asarray(s) for s in sequences]
    for i, s in enumerate(seqs):
        if s.ndim != 1 or s.size == 0 or not np.issubdtype(s.dtype, np.integer):
            raise ValueError(f"sequences[{i}] must be a non-empty 1-D sequence of token ids, got shape {s.shape}")
    if not seqs:
        raise ValueError("sequences is empty")
    return seqs


def pad_sequences(sequences, *, length: int | None = None, pad_id: int = 0) -> Layout:
    """One sequence per row, padded at the end with `pad_id` to `length` (default: the longest)."""
    seqs = _as_sequences(sequences)
    longest = max(s.size for s in seqs)
    length = longest if length is None else length
    if length < longest:
        raise ValueError(f"length={length} is shorter than the longest sequence ({longest} tokens)")
    tokens = np.full((len(seqs), length), pad_id, np.int32)
    for i, s in enumerate(seqs):
        tokens[i, : s.size] = s
    n = len(seqs)
    return Layout(tokens, None, np.arange(n), np.zeros(n, int), np.array([s.size for s in seqs]))


def pack_sequences(sequences, *, length: int) -> Layout:
    """Sequences packed in order into rows of `length` tokens (a sequence starts a new row when it
    does not fit the current one), each with its own segment id; the rest of a row is one padding
    segment (token 0)."""
    seqs = _as_sequences(sequences)
    if max(s.size for s in seqs) > length:
        raise ValueError(f"length={length} is shorter than the longest sequence ({max(s.size for s in seqs)} tokens)")
    row, start, used = [], [], [0]
    for s in seqs:
        if used[-1] + s.size > length:
            used.append(0)
        row.append(len(used) - 1)
        start.append(used[-1])
        used[-1] += s.size
    tokens = np.zeros((len(used), length), np.int32)
    segment_ids = np.full((len(used), length), len(seqs), np.int32)  # padding: an id of its own
    for i, (s, r, st) in enumerate(zip(seqs, row, start)):
        tokens[r, st : st + s.size] = s
        segment_ids[r, st : st + s.size] = i
    return Layout(tokens, segment_ids, np.array(row), np.array(start), np.array([s.size for s in seqs]))


def completions_log_probs(model, completions, *, layout: str = "packed", length: int | None = None, invariant=False):
    """The trainer's log-probs of each completion's generated tokens (a list of float32 arrays, one
    per completion, to compare with `completion.log_probs`): its sequences scored by one padded or
    packed forward at each completion's temperature."""
    seqs = [c.sequence for c in completions]
    if layout == "packed":
        lay = pack_sequences(seqs, length=length or sum(s.size for s in seqs))
    elif layout == "padded":
        lay = pad_sequences(seqs, length=length)
    else:
        raise ValueError(f"layout must be 'packed' or 'padded', got {layout!r}")
    temperature = np.zeros(lay.tokens.shape, np.float32)
    for c, r, s, n in zip(completions, lay.row, lay.start, lay.length):
        temperature[r, s : s + n] = c.temperature
    score = nnx.jit(
        lambda m, t, s: trainer_log_probs(m, t, segment_ids=s, temperature=temperature, invariant=invariant)
    )
    lp = score(model, jnp.asarray(lay.tokens), None if lay.segment_ids is None else jnp.asarray(lay.segment_ids))
    return [v[c.prompt.size :] for v, c in zip(lay.gather(lp), completions)]
