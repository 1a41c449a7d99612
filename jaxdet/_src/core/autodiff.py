"""Reverse mode, named: the public functions are ``jax.custom_vjp`` functions whose backward is a
jaxdet kernel. Forward mode through them, and differentiating a gradient whose kernel has no rule,
raise errors that name the public function and what is supported, instead of JAX's generic
messages about internal primitives."""

from __future__ import annotations

from jax.extend import core as jex_core
from jax.interpreters import ad

_JVP_OF_CUSTOM_VJP = "forward-mode autodiff (jvp) to a custom_vjp function"


def support_message(public: str, *, higher_order: bool = False) -> str:
    """What `public` supports: reverse mode once (or, with `higher_order`, to any order)."""
    if higher_order:
        return (
            f"{public} supports reverse-mode differentiation to any order (jax.grad, jax.vjp, "
            "jax.value_and_grad); forward mode (jax.jvp, jax.jacfwd, jax.linearize) is not supported yet"
        )
    return (
        f"{public} supports reverse-mode differentiation once (jax.grad, jax.vjp, jax.value_and_grad); "
        "forward mode (jax.jvp, jax.jacfwd, jax.linearize, jax.hessian) and differentiating its gradient "
        "again are not supported yet"
    )


def refuse_jvp(namespace: dict, public_of) -> None:
    """A JVP rule for every primitive in `namespace` (a module's globals) that raises
    NotImplementedError naming the public function ``public_of(params)``."""
    for prim in [v for v in namespace.values() if isinstance(v, jex_core.Primitive)]:

        def rule(primals, tangents, _prim=prim, **params):
            raise NotImplementedError(f"{support_message(public_of(params))} (the internal primitive {_prim.name})")

        ad.primitive_jvps[prim] = rule


def reverse_only(public: str, fn, *args, higher_order: bool = False):
    """``fn(*args)``; JAX's TypeError for forward mode through a custom_vjp function becomes one
    naming `public`. (Under ``jax.jvp`` of a ``jax.jit``-ed function the custom_vjp is met when the
    jitted program is differentiated, outside this frame: JAX's own message then.)"""
    try:
        return fn(*args)
    except TypeError as e:
        if _JVP_OF_CUSTOM_VJP not in str(e):
            raise
        raise TypeError(
            f"{support_message(public, higher_order=higher_order)} (it is a jax.custom_vjp function)"
        ) from e
