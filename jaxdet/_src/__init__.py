"""jaxdet's implementation: one package per primitive (mirroring cuda/<op>/) and core/, which knows no primitive."""
