"""Reference models built from jaxdet ops only (not imported by ``import jaxdet``)."""
