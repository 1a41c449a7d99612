"""Flax NNX objects as arguments of a function transformation, as `nnx.jit` takes them.

`as_pure(fn, args, kwargs)` turns a step that reaches NNX graph nodes (modules, optimizers,
`nnx.Rngs`) through its arguments and changes them in place into a pure function of arrays:
the nodes' state goes in, and their state after the step comes out as part of the result. So a
transformation sees the whole step -- the optimizer's update too, not only what is returned --
and `write_back` puts the new state into the caller's objects afterwards.
"""

from __future__ import annotations

import sys

import jax


def nnx_module(tree):
    """flax.nnx when `tree` holds NNX graph nodes, else None (flax is optional: objects of it can
    exist only once it is imported)."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return None
    leaves = jax.tree.leaves(tree, is_leaf=nnx.graph.is_graph_node)
    return nnx if any(nnx.graph.is_graph_node(x) for x in leaves) else None


def as_pure(nnx, fn, args, kwargs):
    """(pure, pure_args, write_back): ``pure(*pure_args)`` returns ``(fn's result, new state)``;
    ``write_back(new_state)`` updates the objects passed in."""
    leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=nnx.graph.is_graph_node)
    node_at = [i for i, x in enumerate(leaves) if nnx.graph.is_graph_node(x)]
    nodes = tuple(leaves[i] for i in node_at)
    graphdef, state = nnx.split(nodes)
    others = [x for i, x in enumerate(leaves) if i not in node_at]

    def pure(state, others):
        merged = iter(nnx.merge(graphdef, state))
        rest = iter(others)
        rebuilt = [next(merged) if i in node_at else next(rest) for i in range(len(leaves))]
        a, k = jax.tree.unflatten(treedef, rebuilt)
        out = fn(*a, **k)
        _, new_state = nnx.split(tuple(rebuilt[i] for i in node_at))
        return out, new_state

    def write_back(new_state):
        nnx.update(nodes, new_state)

    return pure, (state, others), write_back
