"""A continuous-batching sampler over a KV cache of fixed slots (docs/sampling.md).

Host side (Python, never traced): the queue of requests, which request holds which slot, each
request's position and the tokens it still has to feed. Device side (one jitted call: a step, or
`steps_per_call` decode steps in a `lax.scan`): the model's `extend` over every slot, the choice of
each slot's next token and its log-prob. A step
feeds every slot a chunk of `T` tokens: the next chunk of a prompt not yet fed, else the last
sampled token, padded with positions that continue past the slot's last real token (the model
protocol drops or later overwrites those rows); a free slot is fed positions past the cache's
capacity, which write nothing."""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxdet
from jaxdet._src.core.checks import check_static_int
from jaxdet._src.sampling import sampling_math


@dataclasses.dataclass(frozen=True)
class Completion:
    """A finished request: its prompt, the generated tokens and their log-probs (float32, under
    the request's temperature; greedy requests: under the logits as they are), why it stopped
    ("stop": a stop token, which is included; "length": max_new_tokens), and where it ran (the slot
    and the sampler step at which it joined), which its bits never depend on."""

    request_id: int
    prompt: np.ndarray
    tokens: np.ndarray
    log_probs: np.ndarray
    finish_reason: str
    slot: int
    join_step: int
    temperature: float

    @property
    def sequence(self) -> np.ndarray:
        """The prompt followed by the generated tokens (what the trainer scores)."""
        return np.concatenate([self.prompt, self.tokens])


@dataclasses.dataclass
class _Request:
    request_id: int
    prompt: np.ndarray
    max_new_tokens: int
    temperature: float
    inv_temperature: np.float32
    key: np.ndarray
    stop_tokens: frozenset
    slot: int = -1
    join_step: int = -1
    fed: int = 0  # tokens written to the cache so far (the next token's position)
    pending: list = dataclasses.field(default_factory=list)  # tokens to feed, in order
    tokens: list = dataclasses.field(default_factory=list)
    log_probs: list = dataclasses.field(default_factory=list)


def _bucket(n: int, limit: int) -> int:
    """The chunk length of a step: n rounded up to a power of two, at most `limit` (few shapes, few
    compilations)."""
    t = 1
    while t < n:
        t *= 2
    return min(t, limit)


# A step's host inputs travel as one int32 array [num_slots, 2 W + 6] (one transfer rather than seven;
# a step at decode sizes is mostly host time): tokens [W], positions [W], last, the key's two words,
# the draw index, 1 / temperature (float32 bits) and greedy (0 / 1). Exact: every field is an int32
# or a 32-bit pattern reinterpreted.
_FIELDS_AFTER_TOKENS = 6


def _pack_inputs(tokens, positions, last, keys, steps, inv_temperature, greedy):
    b, width = tokens.shape
    packed = np.empty((b, 2 * width + _FIELDS_AFTER_TOKENS), np.int32)
    packed[:, :width] = tokens
    packed[:, width : 2 * width] = positions
    packed[:, 2 * width] = last
    packed[:, 2 * width + 1 : 2 * width + 3] = keys.view(np.int32)
    packed[:, 2 * width + 3] = steps.view(np.int32)
    packed[:, 2 * width + 4] = inv_temperature.view(np.int32)
    packed[:, 2 * width + 5] = greedy
    return packed


def _unpack_inputs(packed):
    width = (packed.shape[1] - _FIELDS_AFTER_TOKENS) // 2
    as_u32 = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.uint32)
    return (
        packed[:, :width],
        packed[:, width : 2 * width],
        packed[:, 2 * width],
        as_u32(packed[:, 2 * width + 1 : 2 * width + 3]),
        as_u32(packed[:, 2 * width + 3]),
        jax.lax.bitcast_convert_type(packed[:, 2 * width + 4], jnp.float32),
        packed[:, 2 * width + 5] != 0,
    )


def _model_step(graphdef, invariant, state, cache, tokens, positions, last, keys, steps, inv_temperature, greedy):
    """The model's extend over every slot and each slot's next token -> (cache, next_tokens int32
    [num_slots], [num_slots, 2] int32: each slot's next token and its log-prob's float32 bits)."""

    def extend(state, tokens, positions, cache):
        return nnx.merge(graphdef, state).extend(tokens, positions, cache)

    if invariant:  # the model only: the token choice below is jaxdet kernels and exact operations already
        extend = jaxdet.invariant(extend)
    logits, cache = extend(state, tokens, positions, cache)
    rows = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]  # [B, V]
    scaled = sampling_math.scaled_logits(rows, inv_temperature[:, None])
    next_tokens, log_probs = sampling_math.select(scaled, rows, keys, steps, greedy)
    next_tokens = next_tokens.astype(jnp.int32)
    log_probs = jax.lax.bitcast_convert_type(log_probs.astype(jnp.float32), jnp.int32)
    return cache, next_tokens, jnp.stack([next_tokens, log_probs], axis=-1)


def _step(graphdef, invariant, state, cache, packed):
    """One model step over every slot -> (the new cache, [num_slots, 2] int32 drawn: one transfer
    back)."""
    cache, _, drawn = _model_step(graphdef, invariant, state, cache, *_unpack_inputs(packed))
    return cache, drawn


def _decode_steps(graphdef, invariant, num_steps, state, cache, packed):
    """`num_steps` decode steps in one call, every slot fed one token a step: the token each slot
    drew, at the next position, with the next draw index (what `num_steps` calls of `_step` would
    feed a slot that keeps decoding) -> (the new cache, [num_steps, num_slots, 2] int32 drawn)."""
    tokens, positions, last, keys, steps, inv_temperature, greedy = _unpack_inputs(packed)

    # The model's state rides in the carry, unchanged: each step merges the model inside its own
    # trace (a Variable made at one trace level cannot be updated at another).
    def body(carry, _):
        state, cache, tokens, positions, steps = carry
        cache, next_tokens, drawn = _model_step(
            graphdef, invariant, state, cache, tokens, positions, last, keys, steps, inv_temperature, greedy
        )
        return (state, cache, next_tokens[:, None], positions + 1, steps + 1), drawn

    (_, cache, *_), drawn = jax.lax.scan(body, (state, cache, tokens, positions, steps), None, length=num_steps)
    return cache, drawn


class Sampler:
    """Generation from a model of the jaxdet model protocol (`jaxdet.models.llama.Llama`:
    `init_cache`, `extend`) for a ragged stream of requests, with continuous batching.

        sampler = Sampler(model, num_slots=16, capacity=256)
        completions = sampler.generate(prompts, max_new_tokens=32, temperature=1.0,
                                       key=jaxdet.random.key(0))

    or request by request: `add_request(...)` (queued; it takes a free slot at the next `step`),
    `step()` (one jitted model call over all slots; returns the requests that finished), `run()`.

    The contract (tests/test_sampling.py): a request's tokens and log-probs have the same bits
    whatever its slot, its neighbours, the step at which it joins, `num_slots` and
    `prefill_chunk`, and its log-probs equal `trainer_log_probs` of its sequence, bit for bit.
    Its samples come from its own key: draw i uses philox4x32_10([i, 0, SAMPLE_TAG, 0], key).

    `num_slots`: the batch of the cache; `capacity`: cache rows per slot (a request needs
    len(prompt) + max_new_tokens - 1 of them); `prefill_chunk`: the most prompt tokens a slot feeds
    in one step; `invariant`: run the model under `jaxdet.invariant` (a model written with plain JAX
    or flax's own modules); `steps_per_call`: the decode steps one call runs on the device when every
    active slot is decoding (its prompt fed): the host's work and the round trip for the drawn tokens
    are then paid once per `steps_per_call` steps (a decode step of a small model is mostly host
    time), requests join only between calls, and a request that finishes inside a call leaves its
    slot's remaining steps of that call unused. The sampler holds the model's own variables, so a
    model updated in place between steps (an RL loop's optimizer) is sampled with its current
    weights; a model whose structure changes (variables added or replaced) needs a new Sampler."""

    def __init__(
        self,
        model,
        *,
        num_slots: int,
        capacity: int,
        prefill_chunk: int = 32,
        invariant: bool = False,
        steps_per_call: int = 1,
    ):
        for name in ("init_cache", "extend"):
            if not callable(getattr(model, name, None)):
                raise TypeError(
                    f"model must follow the jaxdet model protocol (init_cache, extend; e.g. "
                    f"jaxdet.models.llama.Llama), got {type(model).__name__} without {name}()"
                )
        self.model = model
        self.num_slots = check_static_int(num_slots, "num_slots", minimum=1)
        self.capacity = check_static_int(capacity, "capacity", minimum=1)
        self.prefill_chunk = check_static_int(prefill_chunk, "prefill_chunk", minimum=1)
        self.invariant = bool(invariant)
        self.steps_per_call = check_static_int(steps_per_call, "steps_per_call", minimum=1)
        self.steps_taken = 0
        # The model's own variables (nnx.split returns them, not copies): an update in place (an
        # optimizer step, nnx.update, an assignment to a variable's value) is seen at the next step,
        # without walking the model's graph at every step.
        self._graphdef, self._state = nnx.split(model)
        self._cache = model.init_cache(self.num_slots, self.capacity)
        self._slots: list[_Request | None] = [None] * self.num_slots
        self._queue: collections.deque[_Request] = collections.deque()
        self._next_id = 0
        self._jit_step = jax.jit(functools.partial(_step, self._graphdef, self.invariant), donate_argnums=(1,))
        self._jit_decode = jax.jit(
            functools.partial(_decode_steps, self._graphdef, self.invariant, self.steps_per_call), donate_argnums=(1,)
        )

    # ---- requests ----

    def add_request(
        self,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        key=None,
        stop_tokens: Sequence[int] = (),
    ) -> int:
        """Queues a request; returns its id. temperature 0 is greedy (argmax); above 0 a draw from
        softmax(logits / temperature) with `key` (a jaxdet Philox key, uint32[2]), required then."""
        prompt = np.asarray(prompt)
        if prompt.ndim != 1 or prompt.size == 0 or not np.issubdtype(prompt.dtype, np.integer):
            raise ValueError(f"prompt must be a non-empty 1-D sequence of token ids, got shape {prompt.shape}")
        vocab = getattr(getattr(self.model, "cfg", None), "vocab_size", None)
        if prompt.min() < 0 or (vocab is not None and prompt.max() >= vocab):
            raise ValueError(
                f"prompt token ids must be in [0, {'vocab_size' if vocab is None else f'vocab_size={vocab}'}), "
                f"got {prompt.min()} .. {prompt.max()}"
            )
        max_new_tokens = check_static_int(max_new_tokens, "max_new_tokens", minimum=1)
        need = prompt.size + max_new_tokens - 1
        if need > self.capacity:
            raise ValueError(
                f"a prompt of {prompt.size} tokens and max_new_tokens={max_new_tokens} need {need} cache rows, "
                f"more than the sampler's capacity={self.capacity}"
            )
        inv = sampling_math.inverse_temperature(temperature)
        if inv.ndim != 0:
            raise TypeError(f"temperature must be a scalar, got shape {inv.shape}")
        if temperature == 0:
            key = np.zeros(2, np.uint32) if key is None else sampling_math.request_key(key)
        elif key is None:
            raise ValueError("temperature > 0 draws tokens: pass key=, a jaxdet Philox key (jaxdet.random.key(seed))")
        else:
            key = sampling_math.request_key(key)
        request = _Request(
            request_id=self._next_id,
            prompt=prompt.astype(np.int32),
            max_new_tokens=max_new_tokens,
            temperature=float(temperature),
            inv_temperature=inv,
            key=key,
            stop_tokens=frozenset(int(t) for t in stop_tokens),
        )
        request.pending = [int(t) for t in request.prompt]
        self._next_id += 1
        self._queue.append(request)
        return request.request_id

    @property
    def num_active(self) -> int:
        return sum(r is not None for r in self._slots)

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    def has_work(self) -> bool:
        return bool(self._queue) or self.num_active > 0

    # ---- steps ----

    def _admit(self):
        for slot in range(self.num_slots):
            if self._slots[slot] is None and self._queue:
                request = self._queue.popleft()
                request.slot, request.join_step = slot, self.steps_taken
                self._slots[slot] = request

    def step(self) -> list[Completion]:
        """Admits queued requests into free slots, runs one call over all slots (one model step, or
        `steps_per_call` decode steps when every active slot is decoding) and returns the requests
        that finished in it."""
        self._admit()
        if self.num_active == 0:
            return []
        b = self.num_slots
        width = _bucket(max(len(r.pending) for r in self._slots if r is not None), self.prefill_chunk)
        tokens = np.zeros((b, width), np.int32)
        # Free slots: positions past the capacity (their writes are dropped, their logits unused).
        positions = np.broadcast_to(self.capacity + np.arange(width, dtype=np.int32), (b, width)).copy()
        last = np.zeros(b, np.int32)
        keys = np.zeros((b, 2), np.uint32)
        steps = np.zeros(b, np.uint32)
        inv_temperature = np.ones(b, np.float32)
        greedy = np.ones(b, bool)
        fed = [0] * b
        for slot, r in enumerate(self._slots):
            if r is None:
                continue
            n = min(len(r.pending), width)
            tokens[slot, :n] = r.pending[:n]
            positions[slot] = r.fed + np.arange(width, dtype=np.int32)
            last[slot] = n - 1
            keys[slot] = r.key
            steps[slot] = len(r.tokens)
            inv_temperature[slot] = r.inv_temperature
            greedy[slot] = r.temperature == 0
            fed[slot] = n
        packed = _pack_inputs(tokens, positions, last, keys, steps, inv_temperature, greedy)
        # Width 1: every active slot draws at this step (a prompt's last token, or its last draw),
        # so every later step of the call feeds each slot its draw.
        if width == 1 and self.steps_per_call > 1:
            self._cache, drawn = self._jit_decode(self._state, self._cache, packed)
            drawn = np.asarray(drawn)
        else:
            self._cache, drawn = self._jit_step(self._state, self._cache, packed)
            drawn = np.asarray(drawn)[None]
        finished = []
        for step_drawn in drawn:
            finished += self._absorb(step_drawn, fed)
            fed = [1] * b  # later steps of a decode call feed every slot its draw
            self.steps_taken += 1
        return finished

    def _absorb(self, drawn, fed) -> list[Completion]:
        """One step's results: each active slot fed fed[slot] tokens and drew drawn[slot] (the token,
        its log-prob's float32 bits); returns the requests it finished, whose slots it frees."""
        next_tokens, log_probs = drawn[:, 0], drawn[:, 1].view(np.float32)
        finished = []
        for slot, r in enumerate(self._slots):
            if r is None:
                continue
            r.fed += fed[slot]
            del r.pending[: fed[slot]]
            if r.pending:  # still feeding its prompt: this step's logits are not a draw
                continue
            token = int(next_tokens[slot])
            r.tokens.append(token)
            r.log_probs.append(log_probs[slot])
            reason = "stop" if token in r.stop_tokens else "length" if len(r.tokens) == r.max_new_tokens else None
            if reason is None:
                r.pending = [token]
                continue
            finished.append(
                Completion(
                    request_id=r.request_id,
                    prompt=r.prompt,
                    tokens=np.asarray(r.tokens, np.int32),
                    log_probs=np.asarray(r.log_probs, np.float32),
                    finish_reason=reason,
                    slot=slot,
                    join_step=r.join_step,
                    temperature=r.temperature,
                )
            )
            self._slots[slot] = None
        return finished

    def run(self) -> list[Completion]:
        """Steps until every queued and active request has finished; returns them by request id."""
        done = []
        while self.has_work():
            done.extend(self.step())
        return sorted(done, key=lambda c: c.request_id)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        key=None,
        stop_tokens: Sequence[int] = (),
    ) -> list[Completion]:
        """Completions of `prompts`, in their order. With temperature > 0, prompt i draws with
        jaxdet.random.fold_in(key, i), so its tokens do not depend on the other prompts."""
        if self.has_work():
            raise RuntimeError("generate() needs an idle sampler; finish the requests in flight with run() first")
        if temperature != 0 and key is None:
            raise ValueError("temperature > 0 draws tokens: pass key=, a jaxdet Philox key (jaxdet.random.key(seed))")
        ids = []
        for i, prompt in enumerate(prompts):
            request_key = None if key is None else jaxdet.random.fold_in(key, i)
            ids.append(
                self.add_request(
                    prompt,
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    key=request_key,
                    stop_tokens=stop_tokens,
                )
            )
        by_id = {c.request_id: c for c in self.run()}
        return [by_id[i] for i in ids]
