"""jaxdet.sampling's trainer data-parallel on D = 1, 2, 4 of 8 simulated CPU devices (this file
reruns itself in a child pytest when this process has fewer; tests/multidevice.py): each device
scores its rows of the batch, and every sequence gets the sampler's log-probs, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bitwise import assert_bitwise
from flax import nnx
from jax.sharding import PartitionSpec as P
from multidevice import mesh, on_devices, put

import jaxdet
from jaxdet import sampling
from jaxdet.models.llama import Llama, LlamaConfig


@on_devices
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_data_parallel_trainer_equals_the_sampler(layout):
    cfg = LlamaConfig(vocab_size=32, d_model=128, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=128, max_len=32)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 32, n) for n in rng.integers(1, 8, 8)]
    completions = sampling.Sampler(model, num_slots=3, capacity=16, prefill_chunk=4).generate(
        prompts, max_new_tokens=4, temperature=1.0, key=jaxdet.random.key(5)
    )
    seqs = [c.sequence for c in completions]
    # 8 rows: one sequence per row (padded) or two per row (packed), so D = 1, 2, 4 split whole rows.
    lay = sampling.pad_sequences(seqs) if layout == "padded" else sampling.pack_sequences(seqs, length=24)
    if layout == "packed":
        assert lay.tokens.shape[0] < 8
        extra = 8 - lay.tokens.shape[0]  # whole padding rows, so every D divides the batch
        lay = sampling.Layout(
            np.concatenate([lay.tokens, np.zeros((extra, 24), np.int32)]),
            np.concatenate([lay.segment_ids, np.zeros((extra, 24), np.int32)]),
            lay.row,
            lay.start,
            lay.length,
        )
    tokens = jnp.asarray(lay.tokens)
    segment_ids = None if lay.segment_ids is None else jnp.asarray(lay.segment_ids)
    graphdef, state = nnx.split(model)

    def score(state, tokens, segment_ids):
        return sampling.trainer_log_probs(nnx.merge(graphdef, state), tokens, segment_ids=segment_ids, temperature=1.0)

    for d in (1, 2, 4):
        m = mesh(d)
        specs = (P(), P("data"), None if segment_ids is None else P("data"))
        in_shard_map = jax.jit(jax.shard_map(score, mesh=m, in_specs=specs, out_specs=P("data")))
        sharded_jit = jax.jit(score)(
            put(state, m, P()),
            put(tokens, m, P("data")),
            None if segment_ids is None else put(segment_ids, m, P("data")),
        )
        for how, lp in (("shard_map", in_shard_map(state, tokens, segment_ids)), ("sharded jit", sharded_jit)):
            for scored, c in zip(lay.gather(lp), completions):
                assert_bitwise(scored[c.prompt.size :], c.log_probs, f"{how}, D={d}, request {c.request_id}")
