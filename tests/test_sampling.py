"""jaxdet.sampling (docs/sampling.md): the sampler's per-token log-probs equal the trainer's, bit for
bit, for every request whatever its slot, neighbours, join step and batch; the trainer by a packed
and by a padded forward. The data-parallel trainer is in tests/test_sampling_sharding.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bitwise import assert_bitwise
from flax import nnx

import jaxdet
from jaxdet import sampling
from jaxdet.models.llama import Llama, LlamaConfig

VOCAB = 32


def tiny_llama(modules="jaxdet", *, n_layers=2, seed=0, dtype=jnp.float32):
    """Grouped-query attention (2 query heads per KV head of jaxdet.attention's smallest head dim)."""
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        d_model=128,
        n_layers=n_layers,
        n_heads=2,
        n_kv_heads=1,
        d_ff=128,
        max_len=32,
        modules=modules,
        dtype=dtype,
        param_dtype=dtype,
    )
    return Llama(cfg, rngs=nnx.Rngs(seed))


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def _prompts(n=6, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size) for size in rng.integers(1, 12, n)]


def _run(model, prompts, *, num_slots, prefill_chunk, arrivals, max_new_tokens=5, steps_per_call=1):
    """Requests i (greedy when i % 3 == 0, else temperature 0.7 or 1.3) added before call
    arrivals[i] of step(); returns the completions by request id."""
    sampler = sampling.Sampler(
        model, num_slots=num_slots, capacity=24, prefill_chunk=prefill_chunk, steps_per_call=steps_per_call
    )
    order = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    ids, done, step = {}, [], 0
    while order or sampler.has_work():
        while order and arrivals[order[0]] <= step:
            i = order.pop(0)
            temperature = 0.0 if i % 3 == 0 else (0.7 if i % 3 == 1 else 1.3)
            ids[
                sampler.add_request(
                    prompts[i],
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    key=jaxdet.random.fold_in(jaxdet.random.key(7), i),
                )
            ] = i
        done.extend(sampler.step())
        step += 1
    return {ids[c.request_id]: c for c in done}


def test_request_bits_do_not_depend_on_slot_neighbours_join_step_or_batch(model):
    prompts = _prompts()
    runs = [
        _run(model, prompts, num_slots=1, prefill_chunk=1, arrivals=[0] * 6),  # alone, token by token
        _run(model, prompts, num_slots=2, prefill_chunk=4, arrivals=[0, 0, 3, 1, 5, 2]),
        _run(model, prompts, num_slots=4, prefill_chunk=16, arrivals=[4, 3, 2, 1, 0, 0]),
        _run(model, prompts, num_slots=8, prefill_chunk=8, arrivals=[0] * 6),
        # decode steps three or four to a call: requests join between calls, and finish inside them
        _run(model, prompts, num_slots=3, prefill_chunk=4, arrivals=[0, 2, 0, 5, 1, 3], steps_per_call=3),
        _run(model, prompts, num_slots=8, prefill_chunk=16, arrivals=[0] * 6, steps_per_call=4),
    ]
    reference = runs[0]
    for run in runs[1:]:
        for i, c in run.items():
            assert_bitwise(c.tokens, reference[i].tokens, f"request {i} tokens")
            assert_bitwise(c.log_probs, reference[i].log_probs, f"request {i} log-probs")
    # The runs did place requests differently (so the comparison above says something).
    assert len({(r[i].slot, r[i].join_step) for r in runs for i in r}) > 2 * len(prompts)
    assert all(len(c.tokens) == 5 and c.finish_reason == "length" for c in reference.values())


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_trainer_log_probs_equal_the_samplers(model, layout):
    prompts = _prompts(seed=1)
    sampler = sampling.Sampler(model, num_slots=3, capacity=24, prefill_chunk=4)
    completions = sampler.generate(prompts[:3], max_new_tokens=6, temperature=1.0, key=jaxdet.random.key(1))
    completions += sampler.generate(prompts[3:], max_new_tokens=4)  # greedy
    for scored, c in zip(sampling.completions_log_probs(model, completions, layout=layout), completions):
        assert_bitwise(scored, c.log_probs, f"request {c.request_id} ({layout})")
    # Each sequence scored in other company: alone, and reversed in a padded batch of longer rows.
    for c in completions[:2]:
        (alone,) = sampling.completions_log_probs(model, [c], layout=layout)
        assert_bitwise(alone, c.log_probs, "alone")
    reversed_ = sampling.completions_log_probs(model, completions[::-1], layout="padded", length=24)
    for scored, c in zip(reversed_, completions[::-1]):
        assert_bitwise(scored, c.log_probs, "reversed, padded to 24")


def test_trainer_log_probs_layout_and_gradient(model):
    seqs = [np.array([1, 2, 3, 4]), np.array([5, 6, 7])]
    packed = sampling.pack_sequences(seqs, length=8)
    assert packed.tokens.tolist() == [[1, 2, 3, 4, 5, 6, 7, 0]]
    assert packed.segment_ids.tolist() == [[0, 0, 0, 0, 1, 1, 1, 2]]
    padded = sampling.pad_sequences(seqs)
    score = nnx.jit(sampling.trainer_log_probs)
    lp_packed = score(model, jnp.asarray(packed.tokens), segment_ids=jnp.asarray(packed.segment_ids))
    lp_padded = score(model, jnp.asarray(padded.tokens))
    for a, b in zip(packed.gather(lp_packed), padded.gather(lp_padded)):
        assert a[0] == 0.0 and b[0] == 0.0  # a sequence's first token has no log-prob
        assert_bitwise(a, b, "packed vs padded")
    # Against the logits: log_softmax of the previous position's row, at the token.
    logits = nnx.jit(lambda m, t: m(t))(model, jnp.asarray(padded.tokens))
    want = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), padded.tokens[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(lp_padded)[:, 1:], want, rtol=1e-5, atol=1e-6)
    mask = padded.mask(begin=[1, 1])
    assert mask.tolist() == [[False, True, True, True], [False, True, True, False]]

    def loss(m):
        lp = sampling.trainer_log_probs(m, jnp.asarray(padded.tokens), temperature=0.8)
        return -jnp.sum(jnp.where(mask, lp, 0.0))

    grads = nnx.jit(nnx.grad(loss))(model)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    assert any(bool(jnp.any(g != 0)) for g in jax.tree.leaves(grads))


def test_draws_follow_the_softmax():
    # The inverse-CDF draw of jaxdet's softmax, over 20000 steps of one key: frequencies within
    # 5 standard deviations of the probabilities; greedy is the argmax.
    from jaxdet._src.sampling import sampling_math

    logits = jnp.array([[2.0, 0.0, -1.0, 1.0, -30.0, 0.5]], jnp.float32)
    n = 20000
    keys = jnp.broadcast_to(jaxdet.random.key(3), (n, 2))
    scaled = jnp.broadcast_to(logits, (n, 6))
    tokens, lps = jax.jit(sampling_math.select)(
        scaled, scaled, keys, jnp.arange(n, dtype=jnp.uint32), jnp.zeros(n, bool)
    )
    p = np.asarray(jax.nn.softmax(logits[0]))
    freq = np.bincount(np.asarray(tokens), minlength=6) / n
    assert np.all(np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-9), (freq, p)
    assert_bitwise(lps, jaxdet.label_log_probs(scaled, tokens), "log-probs of the drawn tokens")
    greedy, _ = sampling_math.select(
        scaled[:2], scaled[:2], keys[:2], jnp.arange(2, dtype=jnp.uint32), jnp.ones(2, bool)
    )
    assert greedy.tolist() == [0, 0]


def test_stop_tokens_and_sampler_bookkeeping(model):
    sampler = sampling.Sampler(model, num_slots=2, capacity=16)
    first = sampler.generate([[1, 2, 3]], max_new_tokens=4, temperature=1.0, key=jaxdet.random.key(0))[0]
    stop = int(first.tokens[-1])
    n = first.tokens.tolist().index(stop) + 1  # the stop token's first draw ends the request
    again = sampler.generate(
        [[1, 2, 3], [4, 5]], max_new_tokens=4, temperature=1.0, key=jaxdet.random.key(0), stop_tokens=[stop]
    )
    assert again[0].finish_reason == "stop" and again[0].tokens.tolist() == first.tokens[:n].tolist()
    assert_bitwise(again[0].log_probs, first.log_probs[:n], "stopped early")
    assert again[0].sequence.tolist() == [1, 2, 3] + first.tokens[:n].tolist()
    assert not sampler.has_work() and sampler.num_active == 0
    # Four decode steps to a call: the stop inside a call ends the request at the same token.
    calls = sampling.Sampler(model, num_slots=2, capacity=16, steps_per_call=4)
    batched = calls.generate(
        [[1, 2, 3], [4, 5]], max_new_tokens=4, temperature=1.0, key=jaxdet.random.key(0), stop_tokens=[stop]
    )
    for a, b in zip(batched, again):
        assert a.finish_reason == b.finish_reason and a.tokens.tolist() == b.tokens.tolist()
        assert_bitwise(a.log_probs, b.log_probs, f"request {a.request_id}, decode calls of 4 steps")
    assert not calls.has_work()


def test_sampler_follows_updates_in_place():
    model = tiny_llama(n_layers=1, seed=4)
    sampler = sampling.Sampler(model, num_slots=2, capacity=8)
    before = sampler.generate([[1, 2]], max_new_tokens=3)[0]
    nnx.update(model, jax.tree.map(lambda x: x * 1.5, nnx.state(model, nnx.Param)))
    after = sampler.generate([[1, 2]], max_new_tokens=3)[0]
    fresh = sampling.Sampler(model, num_slots=2, capacity=8).generate([[1, 2]], max_new_tokens=3)[0]
    assert_bitwise(after.log_probs, fresh.log_probs, "after the update")
    assert not np.array_equal(after.log_probs, before.log_probs)


def test_bad_arguments_raise_naming_them(model):
    sampler = sampling.Sampler(model, num_slots=2, capacity=8)
    with pytest.raises(ValueError, match="capacity=8"):
        sampler.add_request([1] * 6, max_new_tokens=4)
    with pytest.raises(ValueError, match="key="):
        sampler.add_request([1], max_new_tokens=2, temperature=1.0)
    with pytest.raises(ValueError, match="temperature"):
        sampler.add_request([1], max_new_tokens=2, temperature=-1.0, key=jaxdet.random.key(0))
    with pytest.raises(TypeError, match="Philox"):
        sampler.add_request([1], max_new_tokens=2, temperature=1.0, key=jax.random.key(0))
    with pytest.raises(ValueError, match="prompt"):
        sampler.add_request([], max_new_tokens=2)
    with pytest.raises(ValueError, match=f"vocab_size={VOCAB}"):
        sampler.add_request([1, VOCAB], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        sampler.add_request([1], max_new_tokens=0)
    with pytest.raises(TypeError, match="model protocol"):
        sampling.Sampler(object(), num_slots=1, capacity=4)
    with pytest.raises(ValueError, match="num_slots"):
        sampling.Sampler(model, num_slots=0, capacity=4)
    with pytest.raises(ValueError, match="steps_per_call"):
        sampling.Sampler(model, num_slots=1, capacity=4, steps_per_call=0)
    with pytest.raises(TypeError, match="tokens"):
        sampling.trainer_log_probs(model, jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="segment_ids"):
        sampling.trainer_log_probs(model, jnp.zeros((1, 4), jnp.int32), segment_ids=jnp.zeros((1, 3), jnp.int32))
    with pytest.raises(ValueError, match="temperature must broadcast"):
        sampling.trainer_log_probs(model, jnp.zeros((2, 4), jnp.int32), temperature=np.ones(3))
    with pytest.raises(TypeError, match="traced"):
        jax.jit(lambda t: sampling.trainer_log_probs(model, jnp.zeros((1, 4), jnp.int32), temperature=t))(1.0)
    with pytest.raises(ValueError, match="length=2"):
        sampling.pack_sequences([[1, 2, 3]], length=2)
    assert sampler.num_queued == 0  # nothing half-added


def test_flax_modules_under_invariant_keep_the_contract():
    # The plain-JAX twin (flax's own modules, jax.nn.dot_product_attention over a masked cache):
    # run under jaxdet.invariant, sampler and trainer agree bit for bit again, whatever the slots.
    flax_model = tiny_llama("flax", seed=1)
    prompts = _prompts(4, seed=3)
    completions = []
    for num_slots, chunk, per_call in ((1, 1, 1), (3, 4, 3)):
        sampler = sampling.Sampler(
            flax_model, num_slots=num_slots, capacity=16, prefill_chunk=chunk, invariant=True, steps_per_call=per_call
        )
        completions.append(sampler.generate(prompts, max_new_tokens=4, temperature=1.0, key=jaxdet.random.key(2)))
    for a, b in zip(*completions):
        assert_bitwise(a.log_probs, b.log_probs, f"request {a.request_id}, 1 vs 3 slots")
    for layout in ("packed", "padded"):
        scored = sampling.completions_log_probs(flax_model, completions[1], layout=layout, invariant=True)
        for lp, c in zip(scored, completions[1]):
            assert_bitwise(lp, c.log_probs, f"request {c.request_id} ({layout}, invariant)")


def _contract_holds(model, prompts, what):
    """Slots and join steps change no bit; the packed and padded trainers give the sampler's bits."""
    n = len(prompts)
    runs = [
        _run(model, prompts, num_slots=1, prefill_chunk=1, arrivals=[0] * n),
        _run(model, prompts, num_slots=4, prefill_chunk=8, arrivals=list(range(n))),
        _run(model, prompts, num_slots=3, prefill_chunk=4, arrivals=list(range(n)), steps_per_call=3),
    ]
    for run in runs[1:]:
        for i, c in run.items():
            assert_bitwise(c.tokens, runs[0][i].tokens, f"request {i} tokens ({what})")
            assert_bitwise(c.log_probs, runs[0][i].log_probs, f"request {i} ({what})")
    completions = [runs[1][i] for i in sorted(runs[1])]
    for layout in ("packed", "padded"):
        for scored, c in zip(sampling.completions_log_probs(model, completions, layout=layout), completions):
            assert_bitwise(scored, c.log_probs, f"request {c.request_id} ({layout}, {what})")


def test_bfloat16_model_keeps_the_contract():
    _contract_holds(tiny_llama(n_layers=1, dtype=jnp.bfloat16), _prompts(4, seed=4), "bfloat16")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_gpu_sampler_log_probs_equal_the_trainers(dtype, on_gpu):
    _contract_holds(tiny_llama(dtype=dtype), _prompts(8, seed=2), f"GPU, {jnp.dtype(dtype).name}")
