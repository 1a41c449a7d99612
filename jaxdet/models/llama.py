"""A Llama-style decoder in Flax NNX (RoPE, grouped-query attention, SwiGLU, RMSNorm; a tied or
untied head) whose parameters load from the common Llama checkpoints' names (docs/flax.md).

``LlamaConfig.modules`` picks the building blocks:

* ``"jaxdet"``: the ``jaxdet.nnx`` drop-ins and ``jaxdet.attention``. A token's logits depend on its
  own sequence only: the same bits alone, in a padded batch, packed with ``segment_ids``, and
  token by token (or chunk by chunk) through ``extend`` over a KV cache.
* ``"flax"``: flax's own ``nnx.Embed`` / ``nnx.Linear`` / ``nnx.RMSNorm`` and
  ``jax.nn.dot_product_attention(implementation=cfg.attention)``: plain JAX with no jaxdet call,
  the twin to compare with (it drifts with the batch) or to run under ``jaxdet.invariant``.

RoPE reads its cos/sin rows from a table computed once in float64 NumPy and rounded to float32
(a gather, exact), so the rotation of a position has the same bits in every program.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["LlamaConfig", "Llama", "KVCache", "from_checkpoint", "to_checkpoint"]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    max_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dtype: Any = jnp.float32  # activations and the KV cache
    param_dtype: Any = jnp.float32
    modules: str = "jaxdet"  # "jaxdet" (jaxdet.nnx drop-ins) or "flax" (flax's modules, plain JAX)
    attention: str = "xla"  # modules="flax" only: jax.nn.dot_product_attention's "xla" or "cudnn"

    def __post_init__(self):
        if self.modules not in ("jaxdet", "flax"):
            raise ValueError(f'modules must be "jaxdet" or "flax", got {self.modules!r}')
        if self.attention not in ("xla", "cudnn"):
            raise ValueError(f'attention must be "xla" or "cudnn", got {self.attention!r}')
        if self.modules == "jaxdet" and self.attention != "xla":
            raise ValueError(
                f"attention={self.attention!r} selects jax.nn.dot_product_attention's implementation, used "
                'with modules="flax" only (modules="jaxdet" runs jaxdet.attention)'
            )
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must divide d_model ({self.d_model}) and n_kv_heads "
                f"({self.n_kv_heads}) must divide n_heads"
            )
        if self.head_dim % 2:
            raise ValueError(f"the head dimension d_model / n_heads must be even for RoPE, got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@flax.struct.dataclass
class KVCache:
    """Per layer ``k[i]``, ``v[i]``: ``[batch, capacity, n_kv_heads, head_dim]`` in ``cfg.dtype``;
    row ``p`` of slot ``b`` holds the key / value of the token at position ``p`` of sequence ``b``."""

    k: tuple
    v: tuple

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]


@functools.lru_cache(maxsize=16)
def _rope_table(max_len: int, head_dim: int, theta: float):
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (np.arange(half, dtype=np.float64) * 2.0 / head_dim))
    angles = np.arange(max_len, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _rope(cfg: LlamaConfig, x, positions):
    """x [B, T, H, hd] rotated by the angles of positions [B, T] (the rotate-half layout of the
    Llama checkpoints); computed in float32, rounded once to x's dtype."""
    cos_table, sin_table = _rope_table(cfg.max_len, cfg.head_dim, float(cfg.rope_theta))
    # Positions past the table are padding (their results are never read); clip keeps the gather in range.
    cos = jnp.take(jnp.asarray(cos_table), positions, axis=0, mode="clip")[:, :, None, :]
    sin = jnp.take(jnp.asarray(sin_table), positions, axis=0, mode="clip")[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    a, b, c, d = x1 * cos, x2 * sin, x2 * cos, x1 * sin
    if cfg.modules == "jaxdet":
        a, b, c, d = _rounded_products(a, b, c, d)
    return jnp.concatenate([a - b, c + d], axis=-1).astype(x.dtype)


def _rounded_products(*products):
    """The float32 products, each rounded on its own before any add reads it.

    XLA:CPU lets LLVM contract a multiply and an add of one fused loop into one FMA, so whether
    ``x1 * cos - x2 * sin`` rounds once or twice would follow fusion decisions (jit or eager, the
    program's shapes). Each product's bits pass through an xor with a zero that only exists at run
    time (the sum of one +0 by ``jaxdet.sum``, a custom call), which no compiler can see through, so
    the product is stored rounded and the add is a plain add on every backend."""
    import jaxdet  # noqa: PLC0415

    zero = jax.lax.bitcast_convert_type(jaxdet.sum(jnp.zeros((1,), jnp.float32)), jnp.uint32)
    return tuple(
        jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(p, jnp.uint32) ^ zero, jnp.float32) for p in products
    )


def _blocks(cfg: LlamaConfig):
    if cfg.modules == "jaxdet":
        import jaxdet.nnx as jnnx  # noqa: PLC0415

        return jnnx.Linear, jnnx.Embed, jnnx.RMSNorm, jnnx.dot_general
    return nnx.Linear, nnx.Embed, nnx.RMSNorm, jax.lax.dot_general


def _attention(cfg: LlamaConfig, q, k, v, *, segment_ids=None, q_positions=None):
    """Causal attention of q [B, T, N, hd] over k, v [B, S, K, hd]: row t of a sequence sees its
    rows 0 .. t (with q_positions: rows 0 .. q_positions[b, t] of the cache; with segment_ids:
    the rows of its own segment up to itself)."""
    if cfg.modules == "jaxdet":
        import jaxdet  # noqa: PLC0415

        return jaxdet.attention(q, k, v, causal=True, q_positions=q_positions, segment_ids=segment_ids)
    T, S = q.shape[1], k.shape[1]
    if q_positions is not None:
        mask = jnp.arange(S)[None, None, None, :] <= q_positions[:, None, :, None]
    elif segment_ids is not None:
        same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
        mask = same & jnp.tril(jnp.ones((T, S), bool))[None, None]
    else:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=cfg.attention)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=cfg.attention)


def _qkv_widths(cfg: LlamaConfig):
    """qkv_proj's columns of q, of k and of v, in that order."""
    return [cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim]


class Attention(nnx.Module):
    """``qkv_proj``: the query, key and value projections as one kernel ``[d, (n_heads + 2 n_kv_heads)
    head_dim]`` (columns q | k | v), so that a decode step reads the three weights in one product;
    a column's bits do not depend on its neighbours (jaxdet.matmul's contract), so q, k and v are
    those of three separate products. ``o_proj``: the output projection."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        Linear = _blocks(cfg)[0]
        kw = dict(use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        hd = cfg.head_dim
        self.qkv_proj = Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_heads) * hd, **kw)
        self.o_proj = Linear(cfg.n_heads * hd, cfg.d_model, **kw)

    def qkv(self, cfg: LlamaConfig, h, positions):
        B, T, _ = h.shape
        hd = cfg.head_dim
        q, k, v = jnp.split(self.qkv_proj(h), np.cumsum(_qkv_widths(cfg))[:-1].tolist(), axis=-1)
        q = q.reshape(B, T, cfg.n_heads, hd)
        k = k.reshape(B, T, cfg.n_kv_heads, hd)
        v = v.reshape(B, T, cfg.n_kv_heads, hd)
        return _rope(cfg, q, positions), _rope(cfg, k, positions), v


class MLP(nnx.Module):
    """SwiGLU: ``gate_up_proj`` holds the gate and up projections as one kernel ``[d, 2 d_ff]``
    (columns gate | up, one product as above), ``down_proj`` the down projection."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        Linear = _blocks(cfg)[0]
        kw = dict(use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.gate_up_proj = Linear(cfg.d_model, 2 * cfg.d_ff, **kw)
        self.down_proj = Linear(cfg.d_ff, cfg.d_model, **kw)

    def __call__(self, h):
        gate, up = jnp.split(self.gate_up_proj(h), 2, axis=-1)
        return self.down_proj(jax.nn.silu(gate) * up)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        RMSNorm = _blocks(cfg)[2]
        kw = dict(epsilon=cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.input_layernorm = RMSNorm(cfg.d_model, **kw)
        self.self_attn = Attention(cfg, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, **kw)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, cfg: LlamaConfig, x, positions, attend):
        """attend(q, k, v) -> [B, T, N, hd], the attention of this call (whole sequence or cache)."""
        B, T, _ = x.shape
        q, k, v = self.self_attn.qkv(cfg, self.input_layernorm(x), positions)
        a, kv = attend(q, k, v)
        x = x + self.self_attn.o_proj(a.reshape(B, T, cfg.n_heads * cfg.head_dim))
        return x + self.mlp(self.post_attention_layernorm(x)), kv


def _segment_positions(segment_ids):
    """Each token's index in its run of equal segment ids (positions restarting at 0 per segment)."""
    T = segment_ids.shape[1]
    index = jnp.arange(T, dtype=jnp.int32)
    starts_here = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    start = jax.lax.cummax(jnp.where(starts_here, index, 0), axis=1)
    return index - start


def _int_array(x, name, shape):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(x.shape)}")
    return x.astype(jnp.int32)


class Llama(nnx.Module):
    """The decoder: ``embed_tokens``, ``layers[i]`` (``input_layernorm``, ``self_attn.{qkv,o}_proj``,
    ``post_attention_layernorm``, ``mlp.{gate_up,down}_proj``), ``norm`` and ``lm_head`` (None when
    tied): the Llama checkpoints' names, with q/k/v and gate/up each held as one kernel
    (``from_checkpoint`` concatenates them, ``to_checkpoint`` splits them)."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        Linear, Embed, RMSNorm, _ = _blocks(cfg)
        self.embed_tokens = Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        if cfg.tie_embeddings:
            self.lm_head = nnx.data(None)
        else:
            self.lm_head = Linear(
                cfg.d_model, cfg.vocab_size, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs
            )

    def _logits(self, x):
        """float32 logits of the final hidden states: the head's products accumulate in float32 and
        are not rounded to cfg.dtype."""
        cfg = self.cfg
        h = self.norm(x)
        dot_general = _blocks(cfg)[3]
        if self.lm_head is None:
            table = self.embed_tokens.embedding[...].astype(h.dtype)
            dims = (((h.ndim - 1,), (1,)), ((), ()))
        else:
            table = self.lm_head.kernel[...].astype(h.dtype)
            dims = (((h.ndim - 1,), (0,)), ((), ()))
        if h.dtype == jnp.float32:
            return dot_general(h, table, dims)
        return dot_general(h, table, dims, preferred_element_type=jnp.float32)

    def __call__(self, tokens, positions=None, *, segment_ids=None):
        """tokens int32 [B, T] -> logits float32 [B, T, vocab]. positions (RoPE's) default to
        arange(T) per row, restarting at 0 in each run of equal ``segment_ids`` (packed sequences);
        attention is causal within a row, or within a segment."""
        cfg = self.cfg
        tokens = jnp.asarray(tokens)
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens must be an integer array [B, T], got {tokens.dtype}{list(tokens.shape)}")
        B, T = tokens.shape
        if segment_ids is not None:
            segment_ids = _int_array(segment_ids, "segment_ids", (B, T))
        if positions is None:
            if segment_ids is None:
                positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
            else:
                positions = _segment_positions(segment_ids)
        else:
            positions = _int_array(positions, "positions", (B, T))

        def attend(q, k, v):
            return _attention(cfg, q, k, v, segment_ids=segment_ids), None

        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x, _ = layer(cfg, x, positions, attend)
        return self._logits(x)

    def init_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty cache of ``batch`` slots of ``capacity`` rows (capacity <= cfg.max_len)."""
        cfg = self.cfg
        if not 1 <= capacity <= cfg.max_len:
            raise ValueError(f"capacity must be in [1, max_len={cfg.max_len}], got {capacity}")
        shape = (batch, capacity, cfg.n_kv_heads, cfg.head_dim)
        zeros = tuple(jnp.zeros(shape, cfg.dtype) for _ in range(cfg.n_layers))
        return KVCache(k=zeros, v=tuple(jnp.zeros(shape, cfg.dtype) for _ in range(cfg.n_layers)))

    def extend(self, tokens, positions, cache: KVCache):
        """tokens int32 [B, T], positions int32 [B, T] (each token's position in its own sequence;
        the rows of one slot consecutive) -> (logits float32 [B, T, vocab], the new cache).

        Token (b, t)'s key and value are written at row positions[b, t] of slot b (positions >=
        capacity are dropped, never wrapped), and it attends to slot b's rows 0 .. positions[b, t].
        Padding a slot's row: positions that continue past its last real token (their logits are
        to be ignored; the rows they write are overwritten before anything reads them)."""
        cfg = self.cfg
        tokens = jnp.asarray(tokens)
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens must be an integer array [B, T], got {tokens.dtype}{list(tokens.shape)}")
        B, T = tokens.shape
        positions = _int_array(positions, "positions", (B, T))
        if len(cache.k) != cfg.n_layers or cache.k[0].shape[0] != B:
            raise ValueError(
                f"cache must hold {cfg.n_layers} layers of {B} slots (init_cache(batch={B}, capacity)), got "
                f"{len(cache.k)} layers of k{list(cache.k[0].shape)}"
            )
        slots = jnp.arange(B)[:, None]
        new_k, new_v = [], []
        x = self.embed_tokens(tokens)
        for layer, ck, cv in zip(self.layers, cache.k, cache.v):

            def attend(q, k, v, ck=ck, cv=cv):
                ck = ck.at[slots, positions].set(k.astype(ck.dtype), mode="drop")
                cv = cv.at[slots, positions].set(v.astype(cv.dtype), mode="drop")
                return _attention(cfg, q, ck, cv, q_positions=positions), (ck, cv)

            x, (ck, cv) = layer(cfg, x, positions, attend)
            new_k.append(ck)
            new_v.append(cv)
        return self._logits(x), KVCache(k=tuple(new_k), v=tuple(new_v))


# ---- Checkpoints: the names of the common Llama checkpoints, weights [out, in] as torch stores them. ----


def _linear_names(cfg: LlamaConfig):
    """(checkpoint names, path of the Linear in the model, each name's number of columns in the
    kernel, or None for a kernel of one name) of every projection: the fused kernels hold several
    checkpoint entries side by side, in the order of the names."""
    out = []
    for i in range(cfg.n_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        out.append(([attn + f"{p}_proj.weight" for p in "qkv"], ("layers", i, "self_attn", "qkv_proj")))
        out.append(([attn + "o_proj.weight"], ("layers", i, "self_attn", "o_proj")))
        out.append(([mlp + "gate_proj.weight", mlp + "up_proj.weight"], ("layers", i, "mlp", "gate_up_proj")))
        out.append(([mlp + "down_proj.weight"], ("layers", i, "mlp", "down_proj")))
    if not cfg.tie_embeddings:
        out.append((["lm_head.weight"], ("lm_head",)))
    widths = {"qkv_proj": _qkv_widths(cfg), "gate_up_proj": [cfg.d_ff] * 2}
    return [(names, path, widths.get(path[-1])) for names, path in out]


def _norm_names(cfg: LlamaConfig):
    out = [("model.norm.weight", ("norm",))]
    for i in range(cfg.n_layers):
        out.append((f"model.layers.{i}.input_layernorm.weight", ("layers", i, "input_layernorm")))
        out.append((f"model.layers.{i}.post_attention_layernorm.weight", ("layers", i, "post_attention_layernorm")))
    return out


def _module_at(model, path):
    m = model
    for p in path:
        m = m[p] if isinstance(p, int) else getattr(m, p)
    return m


def from_checkpoint(cfg: LlamaConfig, flat: dict, *, rngs: nnx.Rngs) -> Llama:
    """A Llama of ``cfg`` with its parameters from ``flat`` (name -> array): ``model.embed_tokens.weight
    [V, d]``, ``model.layers.{i}.{input_layernorm,post_attention_layernorm}.weight [d]``,
    ``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`` and ``model.layers.{i}.mlp.{gate,up,down}_proj.weight``
    (``[out, in]``, as torch stores them), ``model.norm.weight``, and ``lm_head.weight [V, d]`` (absent
    when ``cfg.tie_embeddings``). Arrays are cast to ``cfg.param_dtype``; a missing, unexpected or
    misshapen entry raises ValueError naming it."""
    model = nnx.eval_shape(lambda r: Llama(cfg, rngs=r), rngs)
    expected = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.d_model)}
    for names, path, widths in _linear_names(cfg):
        d_in, d_out = _module_at(model, path).kernel.shape
        for name, width in zip(names, widths or [d_out]):
            expected[name] = (width, d_in)
    for name, _ in _norm_names(cfg):
        expected[name] = (cfg.d_model,)
    missing = sorted(set(expected) - set(flat))
    unexpected = sorted(set(flat) - set(expected))
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the config: missing {missing}, unexpected {unexpected}")
    for name, shape in expected.items():
        if tuple(np.shape(flat[name])) != shape:
            raise ValueError(f"checkpoint entry {name} must have shape {list(shape)}, got {list(np.shape(flat[name]))}")

    def value(name, transpose=False):
        w = jnp.asarray(flat[name], cfg.param_dtype)
        return w.T if transpose else w

    model.embed_tokens.embedding.set_value(value("model.embed_tokens.weight"))
    for names, path, _ in _linear_names(cfg):
        kernel = jnp.concatenate([value(name, transpose=True) for name in names], axis=1)
        _module_at(model, path).kernel.set_value(kernel)
    for name, path in _norm_names(cfg):
        _module_at(model, path).scale.set_value(value(name))
    return model


def to_checkpoint(model: Llama) -> dict[str, np.ndarray]:
    """The model's parameters under the Llama checkpoint names (``from_checkpoint``'s inverse)."""
    cfg = model.cfg
    flat = {"model.embed_tokens.weight": np.asarray(model.embed_tokens.embedding[...])}
    for names, path, widths in _linear_names(cfg):
        kernel = np.asarray(_module_at(model, path).kernel[...])
        parts = np.split(kernel, np.cumsum(widths)[:-1], axis=1) if widths else [kernel]
        for name, part in zip(names, parts):
            flat[name] = part.T
    for name, path in _norm_names(cfg):
        flat[name] = np.asarray(_module_at(model, path).scale[...])
    return flat
