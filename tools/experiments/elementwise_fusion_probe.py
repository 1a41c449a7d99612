"""Do an elementwise op's bits depend on fusion, eager vs jit, or array length?

Question: `jax.jit(gelu)(x) + y` (two computations) and `jax.jit(lambda x, y: gelu(x) + y)`
(one fused kernel) disagree in the last bit of many elements. Which primitives, which
consumers, which shapes, and which fixes (XLA flags, optimization_barrier, an opaque
bitcast-xor) make them agree?

For each primitive f (float32 and bfloat16) and consumers g in {u+y, u*y, u*y+z}:
  +y *y *y+z  fused jit(g(f(x))) vs jit(f) then jit(g)            (fusion boundary)
  bar         fused with lax.optimization_barrier between f and g vs unfused (g=+y)
  xor         fused with an opaque identity (bitcast, xor runtime 0) vs unfused (g=+y)
  eag+        eager op-by-op f(x)+y vs fused jit                   (g=+y)
  eag*+       eager op-by-op f(x)*y+z vs fused jit                 (g=*y+z)
  eagf        eager f(x) vs jit(f)(x)        (differs only for composites: gelu, softplus...)
  n=1         jit(f) on 1-element arrays vs the same values inside one 4096-element jit(f)
  n=7         the same with 7-element arrays (vector-loop tail only)
  loop        f in a lax.map body over 8-element rows vs one 4096-element jit(f)
  row         jit(h)(X[:1])[0] vs jit(h)(X[:64])[0], rows of 33 and 4096 (batch size),
              h = f then *y+z
Each cell is the number of elements whose bits differ ('.' = 0), summed over the shapes
tested (fusion tests: 33 and 65536 elements; bar, xor: 65536). Inputs are half normal*2,
half a grid over [-12, 12] (mapped into the domain of log, sqrt, erf_inv...), so
saturating tails are hit.

Before the table it prints the backend, devices, XLA_FLAGS and the run-time probes a
library can use (runtime_checks()): fp-contraction of a*b+c inside one jit, bf16 excess
precision inside one jit, and exp/erf bits that depend on the array's length.

Usage (CPU or GPU, jax 0.10/0.11; 111 s on an H100 with jax 0.11.2, ~135 s on a busy
2-core CPU):
  python tools/experiments/elementwise_fusion_probe.py [--platform cpu|gpu] [--prims exp,log]
      [--dtypes float32,bfloat16] [--recipe cpu|gpu] [--bench] [--ptx] [--no-table]
--recipe prepends that backend's determinism flags (RECIPES) to XLA_FLAGS; without it
XLA_FLAGS is used as given. Flags only act if set before jax initialises its backend,
which is why they are set here before `import jax`. --bench times 4096x4096 elementwise
ops and a matmul; --ptx (GPU) dumps a few kernels and counts their float instructions.
"""

import argparse
import os
import sys
import time

import numpy as np

# Candidate flag sets that make elementwise bits independent of fusion, per backend.
RECIPES = {
    # no FMA instructions (AVX has none; llvm.fma in XLA's own polynomials becomes a call to
    # fmaf, same bits); the legacy elemental emitter, whose exp/log/erf/cbrt bits do not
    # depend on array length or a loop body; bf16 rounded after every op
    "cpu": "--xla_cpu_max_isa=AVX --xla_cpu_use_fusion_emitters=false --xla_allow_excess_precision=false",
    # NVPTX: no mul+add contraction by LLVM (it then emits mul.rn/add.rn, which ptxas
    # does not fuse either); bf16 rounded after every op
    "gpu": "--xla_backend_extra_options=-nvptx-fma-level=0 --xla_allow_excess_precision=false",
    # (jax 0.11.2 on an H100 already emits mul.rn/add.rn without the first flag: it pins that)
}

p = argparse.ArgumentParser()
p.add_argument("--platform", default=None, help="cpu, gpu/cuda; default: jax default")
p.add_argument("--prims", default=None, help="comma list; default all")
p.add_argument("--dtypes", default="float32,bfloat16")
p.add_argument("--bench", action="store_true", help="time 4096x4096 gelu+y, x*y+z, exp...")
p.add_argument("--no-table", action="store_true", help="skip the per-primitive table")
p.add_argument(
    "--ptx", action="store_true", help="GPU: dump the PTX of a few kernels and count their float instructions"
)
p.add_argument(
    "--recipe", choices=sorted(RECIPES), default=None, help="prepend RECIPES[name] to XLA_FLAGS before jax starts"
)
args = p.parse_args()
if args.platform:
    os.environ.setdefault("JAX_PLATFORMS", {"gpu": "cuda"}.get(args.platform, args.platform))
if args.recipe:
    os.environ["XLA_FLAGS"] = (RECIPES[args.recipe] + " " + os.environ.get("XLA_FLAGS", "")).strip()

PTX_DIR = "/tmp/elementwise_fusion_probe_dump"
if args.ptx:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={PTX_DIR}"
        " --xla_dump_hlo_as_text --xla_gpu_dump_llvmir=true --xla_dump_emitter_re=.*"
    ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402


# ---------------------------------------------------------------- run-time probes
def contraction_probe():
    """{length: True where one jit computes a*b+c as a fused multiply-add (one rounding)}.

    a = b = 1 + 2^-12: a*b = 1 + 2^-11 + 2^-24 exactly, which rounds (a tie, to even) to
    1 + 2^-11 in float32. With c = -(1 + 2^-11) a separate mul and add give exactly 0, an
    FMA gives 2^-24. Lengths 1, 7, 8, 33, 4096 cover scalar code, vector bodies and tails.
    Inputs are runtime arguments, so nothing is constant-folded.
    """
    f = jax.jit(lambda a, b, c: a * b + c)
    out = {}
    for k in (1, 7, 8, 33, 4096):
        a = jnp.full((k,), 1 + 2.0**-12, jnp.float32)
        c = jnp.full((k,), -(1 + 2.0**-11), jnp.float32)
        out[k] = bool((np.asarray(f(a, a, c)) != 0).any())
    return out


def excess_precision_probe():
    """Number of 256 bfloat16 erfc(x*c) values that one jit computes from an unrounded x*c.

    jnp ops on bfloat16 are computed in float32 and rounded back (CPU: float normalization;
    erfc: CHLO upcasts internally); with --xla_allow_excess_precision=true (the default)
    XLA may drop the round trip f32->bf16->f32 between ops. The reference forces the
    rounding with `opaque`. 0 means no excess precision seen.
    """
    bf = jnp.bfloat16
    x = jnp.linspace(-3, 3, 256, dtype=bf)
    c = jnp.full((256,), 0.7071, bf)
    zero = jnp.zeros((), jnp.int32)
    a = jax.jit(lambda x, c: lax.erfc(x * c))(x, c)
    b = jax.jit(lambda x, c, z: lax.erfc(opaque(x * c, z)))(x, c, zero)
    return ndiff(a, b)


def length_dependence_probe():
    """{op: True where an element's bits depend on the length of the array it is in}.

    XLA:CPU's tiled/fusion emitters call different exp/erf implementations for a vector
    body, a short tail (lengths 3, 5, 6, 7 below 16) and a 1-element array. Compares chunks
    of 7 and 1-element calls against one 56-element call.
    """
    x = jnp.linspace(-10.0, 10.0, 56, dtype=jnp.float32)
    out = {}
    for name, f in (("exp", lax.exp), ("erf", lax.erf)):
        jf = jax.jit(f)
        full = np.asarray(jf(x))
        c7 = np.concatenate([np.asarray(jf(x[i : i + 7])) for i in range(0, 56, 7)])
        v = jnp.full((1,), 3.7439232, jnp.float32)  # erf: 1.0 in scalar code, 1 - 3ulp in vector
        c1 = np.asarray(jf(v))[0] != np.asarray(jf(jnp.concatenate([v, v])))[0]
        out[name] = bool(ndiff(c7, full) or c1)
    return out


def runtime_checks():
    """What a library can check at run time, after the backend started (cheap: ~10 compiles)."""
    return {
        "fma_contraction": any(contraction_probe().values()),
        "length_dependent": length_dependence_probe(),
        "bf16_excess_precision": excess_precision_probe(),
    }


# ---------------------------------------------------------------- primitives
def _pos(x):
    return jnp.abs(x) + 0.01


def _unary(f):
    """A one-operand function as a primitive of the table (w unused)."""
    return lambda x, w: f(x)


# lax's one-operand functions, by name, and the maps of x into the domains of those that need one.
LAX_UNARY = "exp exp2 log tanh logistic erf erfc erf_inv log1p expm1 sqrt rsqrt cbrt sin cos".split()
LAX_DOMAINS = {
    "log": _pos,
    "erf_inv": lambda x: jnp.tanh(x * 0.3) * 0.999,
    "log1p": lambda x: jnp.abs(x) - 0.99,
    "sqrt": _pos,
    "rsqrt": _pos,
}

PRIMS = {  # name: (f(x, w), domain map for x or None)
    **{name: (_unary(getattr(lax, name)), LAX_DOMAINS.get(name)) for name in LAX_UNARY},
    "atan2": (lambda x, w: lax.atan2(x, w), None),
    "div": (lambda x, w: x / w, None),
    "pow": (lambda x, w: lax.pow(x, w), _pos),
    "mul": (lambda x, w: x * w, None),
    "gelu": (_unary(jax.nn.gelu), None),
    "gelu_exact": (_unary(lambda x: jax.nn.gelu(x, approximate=False)), None),
    "softplus": (_unary(jax.nn.softplus), None),
    "silu": (_unary(jax.nn.silu), None),
    "log_softmax": (_unary(jax.nn.log_softmax), None),  # has a reduction
}
ROWWISE = {"log_softmax"}  # mixes a whole row: length tests do not apply

G = {
    "+y": lambda u, y, z: u + y,
    "*y": lambda u, y, z: u * y,
    "*y+z": lambda u, y, z: u * y + z,
}
G_JIT = {k: jax.jit(v) for k, v in G.items()}  # shared across primitives: cache hits


def _uint(dtype):
    return {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[jnp.dtype(dtype).itemsize]


def opaque(u, zero):
    """Identity on bits that no compiler can see through: bitcast, xor a runtime 0, bitcast.
    Forces u to be materialised (rounded to its dtype) and blocks mul+add contraction."""
    it = _uint(u.dtype)
    return lax.bitcast_convert_type(lax.bitcast_convert_type(u, it) ^ zero.astype(it), u.dtype)


def ndiff(a, b):
    """Number of elements whose bits differ (two NaNs count as equal)."""
    a = np.asarray(a)
    b = np.asarray(b)
    ua = a.view(np.dtype(f"u{a.dtype.itemsize}"))
    ub = b.view(np.dtype(f"u{b.dtype.itemsize}"))
    both_nan = np.isnan(a.astype(np.float32)) & np.isnan(b.astype(np.float32))
    return int(((ua != ub) & ~both_nan).sum())


def inputs(shape, dtype, dom, seed=0):
    """x, w, y, z; x is half normal*2, half a grid over [-12, 12], in f's domain."""
    k = jax.random.split(jax.random.key(seed), 5)
    n = int(np.prod(shape))
    grid = jnp.linspace(-12.0, 12.0, n - n // 2)
    grid = jax.random.permutation(k[4], grid)
    x = jnp.concatenate([jax.random.normal(k[0], (n // 2,)) * 2, grid]).reshape(shape)
    if dom is not None:
        x = dom(x)
    w = jax.random.normal(k[1], shape, jnp.float32) + 2.5  # away from 0 for div/pow/atan2
    y = jax.random.normal(k[2], shape, jnp.float32)
    z = jax.random.normal(k[3], shape, jnp.float32)
    return [v.astype(dtype) for v in (x, w, y, z)]


FUSE_SHAPES = [(33,), (65536,)]  # 1 element: see n=1
COLS = ("+y", "*y", "*y+z", "bar", "xor", "eag+", "eag*+", "eagf", "n=1", "n=7", "loop", "row")
N_ONE = 128  # values tested through 1-element calls (one dispatch each)


def probe_prim(name, dtype):
    f, dom = PRIMS[name]
    zero = jnp.zeros((), jnp.int32)
    jf = jax.jit(f)
    res = dict.fromkeys(COLS, 0)
    gg = G["+y"]
    bar = jax.jit(lambda x, w, y, z: gg(lax.optimization_barrier(f(x, w)), y, z))
    xo = jax.jit(lambda x, w, y, z, zero: gg(opaque(f(x, w), zero), y, z))
    for shape in FUSE_SHAPES:
        x, w, y, z = inputs(shape, dtype, dom)
        u = jf(x, w)
        for gk, g in G.items():
            fused = jax.jit(lambda x, w, y, z, g=g: g(f(x, w), y, z))(x, w, y, z)
            unf = G_JIT[gk](u, y, z)
            res[gk] += ndiff(fused, unf)
            if gk == "+y":
                res["eag+"] += ndiff(g(f(x, w), y, z), fused)  # outside jit: op by op
            if gk == "+y" and shape == FUSE_SHAPES[-1]:
                res["bar"] += ndiff(bar(x, w, y, z), unf)
                res["xor"] += ndiff(xo(x, w, y, z, zero), unf)
            if gk == "*y+z":
                res["eag*+"] += ndiff(g(f(x, w), y, z), fused)
        res["eagf"] += ndiff(f(x, w), u)
    # the same values computed in arrays of different lengths / in a loop body
    if name not in ROWWISE:
        x, w, _, _ = inputs((4096,), dtype, dom, seed=1)
        full = np.asarray(jf(x, w))
        sel = np.linspace(0, 4095, N_ONE).astype(int)
        one = [np.asarray(jf(x[i : i + 1], w[i : i + 1]))[0] for i in sel]
        res["n=1"] = ndiff(np.array(one, full.dtype), full[sel])
        res["n=7"] = ndiff(
            np.concatenate([np.asarray(jf(x[i : i + 7], w[i : i + 7])) for i in range(0, 7 * 64, 7)]), full[: 7 * 64]
        )
        body = jax.jit(lambda x, w: lax.map(lambda a: f(a[0], a[1]), (x.reshape(-1, 8), w.reshape(-1, 8))).reshape(-1))
        res["loop"] = ndiff(body(x, w), full)
    h = jax.jit(lambda x, w, y, z: f(x, w) * y + z)
    for W in (33, 4096):
        B = inputs((64, W), dtype, dom, seed=2)
        res["row"] += ndiff(h(*[v[:1] for v in B])[0], h(*B)[0])
    return res


def bench():
    n = 4096
    k = jax.random.split(jax.random.key(3), 3)
    x, y, z = (jax.random.normal(kk, (n, n), jnp.float32) for kk in k)
    zero = jnp.zeros((), jnp.int32)
    cases = {
        "gelu(x)+y": (lambda x, y, z: jax.nn.gelu(x) + y, (x, y, z)),
        "gelu(x)+y xor": (lambda x, y, z, q: opaque(jax.nn.gelu(x), q) + y, (x, y, z, zero)),
        "gelu(x)+y bar": (lambda x, y, z: lax.optimization_barrier(jax.nn.gelu(x)) + y, (x, y, z)),
        "x*y+z": (lambda x, y, z: x * y + z, (x, y, z)),
        "x*y+z xor": (lambda x, y, z, q: opaque(x * y, q) + z, (x, y, z, zero)),
        "exp(x)": (lambda x, y, z: jnp.exp(x), (x, y, z)),
        "erf(x)": (lambda x, y, z: lax.erf(x), (x, y, z)),
        "tanh(x)": (lambda x, y, z: jnp.tanh(x), (x, y, z)),
        "x@y (matmul)": (lambda x, y, z: x @ y, (x, y, z)),
    }
    for name, (fn, a) in cases.items():
        fn = jax.jit(fn)
        fn(*a).block_until_ready()
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            fn(*a).block_until_ready()
            ts.append(time.perf_counter() - t)
        print(f"  bench {name:16s} median {1e3 * sorted(ts)[2]:8.2f} ms")


def ptx_report():
    """Counts of float instructions in the PTX of a few kernels (GPU only)."""
    import glob
    import re

    def ptxprobe_gelu_add(x, y):
        return jax.nn.gelu(x) + y

    def ptxprobe_muladd(x, y, z):
        return x * y + z

    def ptxprobe_exp_mul(x, y):
        return jnp.exp(x) * y

    def ptxprobe_erf_tanh_log(x):
        return lax.erf(x) + jnp.tanh(x) + jnp.log(jnp.abs(x) + 1)

    def ptxprobe_bf16_exp(x):
        return jnp.exp(x.astype(jnp.bfloat16))

    x = jnp.ones((4096,), jnp.float32)
    for fn, a in (
        (ptxprobe_gelu_add, (x, x)),
        (ptxprobe_muladd, (x, x, x)),
        (ptxprobe_exp_mul, (x, x)),
        (ptxprobe_erf_tanh_log, (x,)),
        (ptxprobe_bf16_exp, (x,)),
    ):
        jax.jit(fn)(*a).block_until_ready()
    pat = re.compile(
        r"\b((?:fma|mul|add|sub|div|rcp|sqrt|rsqrt|ex2|lg2|tanh|sin|cos)"
        r"(?:\.[a-z0-9]+)*)\s"
    )
    paths = sorted(p for p in glob.glob(f"{PTX_DIR}/**/*", recursive=True) if "ptxprobe" in p and p.endswith(".ptx"))
    if not paths:
        print(
            f"  no PTX found under {PTX_DIR}; files there: "
            f"{sorted(os.listdir(PTX_DIR))[:12] if os.path.isdir(PTX_DIR) else 'none'}"
        )
    for path in paths:
        counts = {}
        for line in open(path):
            m = pat.search(line.strip())
            if m and (".f32" in m.group(1) or ".bf16" in m.group(1) or ".f16" in m.group(1)):
                counts[m.group(1)] = counts.get(m.group(1), 0) + 1
        print(f"  {os.path.basename(path)}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))


def main():
    t0 = time.time()
    print(f"jax {jax.__version__}  backend {jax.default_backend()}  devices {jax.devices()}")
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print(f"fp-contraction of a*b+c in one jit, by length: {contraction_probe()}")
    print(f"bf16 excess precision in one jit (elements of 256): {excess_precision_probe()}")
    print(f"element bits depend on array length: {length_dependence_probe()}")
    prims = args.prims.split(",") if args.prims else list(PRIMS)
    for dt in [] if args.no_table else args.dtypes.split(","):
        print(f"\n{dt}: elements whose bits differ")
        print(f"{'prim':12s}" + "".join(f"{c:>7s}" for c in COLS))
        for name in prims:
            try:
                r = probe_prim(name, jnp.dtype(dt))
                print(f"{name:12s}" + "".join(f"{(r[c] or '.'):>7}" for c in COLS), flush=True)
            except Exception as e:  # an op unsupported for a dtype on a backend
                print(f"{name:12s} error: {type(e).__name__}: {str(e)[:80]}", flush=True)
    if args.bench:
        bench()
    if args.ptx:
        ptx_report()
    print(f"\ntotal {time.time() - t0:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
