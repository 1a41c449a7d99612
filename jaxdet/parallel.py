"""Device-count-invariant data parallelism: ``tree_psum``, ``tree_sum``, ``value_and_grad`` (docs/parallel.md)."""

from jaxdet._src.parallel.parallel import tree_psum, tree_sum, value_and_grad

__all__ = ["tree_psum", "tree_sum", "value_and_grad"]
