"""Fixed-width vectors of ``uint64`` for numba kernels, with a cheaper 64-bit multiply.

``Vec(n)`` is a numba type whose value is one LLVM ``<n x i64>`` vector. In
``@njit`` code it supports ``+``, ``^``, ``>>`` and ``*`` (with another
``Vec(n)`` or a ``uint64`` scalar, which is broadcast), and:

- ``splat(x, n)``: ``n`` copies of the scalar ``x``;
- ``load(arr, i, n)`` / ``store(arr, i, v)``: ``arr[i : i + n]`` of a 1-d
  ``uint64`` array, unaligned, no bounds check;
- ``load_cols(arr, base, stride, i, g)``: the 4 x ``g`` transpose of ``g`` rows
  of 4 lanes: element ``p * g + k`` is ``arr[base + k * stride + i + p]`` (for 8
  or more rows, written as three stages of two-input shuffles: 24 instructions
  for 16 rows, where LLVM lowers the same transpose written as one shuffle to 32);
- ``prefetch(arr, i)``: a hint to bring the cache line of ``arr[i]`` in;
- ``cat(a, b)`` (``a`` then ``b``, equal widths) and ``split(v)`` (two halves).

``n`` and ``g`` must be compile-time integer constants. LLVM splits a wide
vector into machine registers (4 lanes per AVX2 ``ymm``) and emits their
operations side by side, so one ``Vec(32)`` expression is 8 independent
dependency chains: that is where the kernels get their instruction-level
parallelism from, without hand interleaving.

The multiply. Without AVX-512 there is no 64-bit vector multiply; LLVM builds
one from three 32x32->64 multiplies (``vpmuludq``). Here, when the host lacks
AVX-512DQ, it is built from two: with ``a = ah:al`` and ``b = bh:bl``,
``a * b mod 2^64 = al * bl + ((al * bh + ah * bl) << 32)``; one 32-bit
``vpmulld`` of ``a`` by ``b`` with its halves swapped gives both cross products
at once (only their low 32 bits matter), one ``vpmuludq`` gives ``al * bl``.
With AVX-512DQ, or on another architecture, the plain ``mul`` is emitted (the
fallback). Both are exported as ``mul_split`` and ``mul_plain`` for tests.

Note for numba's on-disk cache: a kernel's cache entry is keyed by its own
source file, not by this one; after changing code here, clear the
``__pycache__`` of the modules that use it.
"""

from __future__ import annotations

import operator

from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.core.extending import intrinsic, models, overload, register_model

__all__ = ["Vec", "SPLIT_MUL", "WIDE", "splat", "load", "store", "load_cols", "prefetch", "cat", "split", "mul_split", "mul_plain"]

_I64 = ir.IntType(64)
_I32 = ir.IntType(32)


def _host_has_avx512dq() -> bool:
    try:
        return "+avx512dq" in llvm.get_host_cpu_features().flatten().split(",")
    except Exception:  # pragma: no cover - feature query unavailable
        return False


def _host_is_x86() -> bool:
    try:
        return llvm.get_process_triple().split("-")[0] in ("x86_64", "i386", "i686")
    except Exception:  # pragma: no cover
        return False


SPLIT_MUL = _host_is_x86() and not _host_has_avx512dq()
"""Whether ``*`` on vectors uses the two-multiply form (else LLVM's own ``mul``)."""


def _host_has_avx512f() -> bool:
    try:
        return "+avx512f" in llvm.get_host_cpu_features().flatten().split(",")
    except Exception:  # pragma: no cover - feature query unavailable
        return False


WIDE = _host_is_x86() and _host_has_avx512f()
"""Whether the host has 32 vector registers of 8 lanes (AVX-512) rather than 16 of 4 (AVX2)."""


class Vec(types.Type):
    """``count`` unsigned 64-bit lanes in one LLVM vector value."""

    def __init__(self, count: int) -> None:
        self.count = count
        super().__init__(name=f"u64x{count}")


@register_model(Vec)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):  # type: ignore[no-untyped-def]
        super().__init__(dmm, fe_type, ir.VectorType(_I64, fe_type.count))


def _mask(values: list[int]) -> ir.Constant:
    return ir.Constant(ir.VectorType(_I32, len(values)), values)


def _splat(builder, x, n):  # type: ignore[no-untyped-def]
    v = builder.insert_element(ir.Constant(ir.VectorType(_I64, n), ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, v, _mask([0] * n))


def _emit_mul_split(builder, a, b):  # type: ignore[no-untyped-def]
    n = a.type.count
    v32 = ir.VectorType(_I32, 2 * n)
    swap = _mask([i ^ 1 for i in range(2 * n)])
    b32 = builder.bitcast(b, v32)
    cross = builder.mul(builder.bitcast(a, v32), builder.shuffle_vector(b32, b32, swap))  # [al*bh, ah*bl] (low 32 bits)
    cross = builder.bitcast(cross, a.type)
    cross = builder.add(cross, builder.shl(cross, ir.Constant(a.type, [32] * n)))  # high half: al*bh + ah*bl
    cross = builder.and_(cross, ir.Constant(a.type, [0xFFFFFFFF00000000] * n))
    low = ir.Constant(a.type, [0xFFFFFFFF] * n)
    lolo = builder.mul(builder.and_(a, low), builder.and_(b, low))  # one vpmuludq
    return builder.add(lolo, cross)


def _emit_mul(builder, a, b):  # type: ignore[no-untyped-def]
    return _emit_mul_split(builder, a, b) if SPLIT_MUL else builder.mul(a, b)


def _binary(emit):  # type: ignore[no-untyped-def]
    """Typing + codegen of ``a <op> b`` for Vec/Vec, Vec/int and int/Vec."""

    def typer(typingctx, a, b):  # type: ignore[no-untyped-def]
        vt = a if isinstance(a, Vec) else b
        if not isinstance(vt, Vec):
            return None
        for t in (a, b):
            if not (isinstance(t, types.Integer) or (isinstance(t, Vec) and t.count == vt.count)):
                return None

        def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
            vals = [
                v if isinstance(t, Vec) else _splat(builder, context.cast(builder, v, t, types.uint64), vt.count)
                for t, v in zip(sig.args, args)
            ]
            return emit(builder, vals[0], vals[1])

        return vt(a, b), codegen

    return intrinsic(typer)


_vxor = _binary(lambda b, x, y: b.xor(x, y))
_vadd = _binary(lambda b, x, y: b.add(x, y))
_vshr = _binary(lambda b, x, y: b.lshr(x, y))
_vmul = _binary(_emit_mul)
mul_split = _binary(_emit_mul_split)
mul_plain = _binary(lambda b, x, y: b.mul(x, y))


def _register(op, impl):  # type: ignore[no-untyped-def]
    @overload(op)
    def _ov(a, b):  # type: ignore[no-untyped-def]
        if isinstance(a, Vec) or isinstance(b, Vec):
            return lambda a, b: impl(a, b)
        return None


for _op, _impl in (
    (operator.xor, _vxor),
    (operator.add, _vadd),
    (operator.rshift, _vshr),
    (operator.mul, _vmul),
):
    _register(_op, _impl)


@intrinsic(prefer_literal=True)
def splat(typingctx, x, n):  # type: ignore[no-untyped-def]
    if not (isinstance(n, types.IntegerLiteral) and isinstance(x, types.Integer)):
        return None
    vt = Vec(n.literal_value)

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return _splat(builder, context.cast(builder, args[0], sig.args[0], types.uint64), vt.count)

    return vt(x, n), codegen


@intrinsic
def cat(typingctx, a, b):  # type: ignore[no-untyped-def]
    if not (isinstance(a, Vec) and isinstance(b, Vec) and a.count == b.count):
        return None
    vt = Vec(2 * a.count)

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return builder.shuffle_vector(args[0], args[1], _mask(list(range(vt.count))))

    return vt(a, b), codegen


@intrinsic
def split(typingctx, v):  # type: ignore[no-untyped-def]
    if not (isinstance(v, Vec) and v.count % 2 == 0):
        return None
    h = v.count // 2
    rt = types.UniTuple(Vec(h), 2)

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        x = args[0]
        lo = builder.shuffle_vector(x, x, _mask(list(range(h))))
        hi = builder.shuffle_vector(x, x, _mask(list(range(h, 2 * h))))
        return context.make_tuple(builder, rt, [lo, hi])

    return rt(v), codegen


def _is_u64_array(arr) -> bool:  # type: ignore[no-untyped-def]
    return isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype == types.uint64


def _vec_ptr(context, builder, arrty, arr, index, n):  # type: ignore[no-untyped-def]
    data = context.make_array(arrty)(context, builder, arr).data
    return builder.bitcast(builder.gep(data, [index]), ir.VectorType(_I64, n).as_pointer())


@intrinsic(prefer_literal=True)
def load(typingctx, arr, i, n):  # type: ignore[no-untyped-def]
    if not (_is_u64_array(arr) and isinstance(i, types.Integer) and isinstance(n, types.IntegerLiteral)):
        return None
    vt = Vec(n.literal_value)

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        index = context.cast(builder, args[1], sig.args[1], types.intp)
        return builder.load(_vec_ptr(context, builder, sig.args[0], args[0], index, vt.count), align=8)

    return vt(arr, i, n), codegen


@intrinsic
def store(typingctx, arr, i, v):  # type: ignore[no-untyped-def]
    if not (_is_u64_array(arr) and isinstance(i, types.Integer) and isinstance(v, Vec)):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        index = context.cast(builder, args[1], sig.args[1], types.intp)
        builder.store(args[2], _vec_ptr(context, builder, sig.args[0], args[0], index, v.count), align=8)
        return context.get_dummy_value()

    return types.none(arr, i, v), codegen


def _concat(builder, vs):  # type: ignore[no-untyped-def]
    while len(vs) > 1:
        m = 2 * vs[0].type.count
        vs = [builder.shuffle_vector(vs[j], vs[j + 1], _mask(list(range(m)))) for j in range(0, len(vs), 2)]
    return vs[0]


def _transpose_staged(builder, rows):  # type: ignore[no-untyped-def]
    """Rows of 4 lanes (a multiple of 8 of them) to position-major order, in three stages of two-input
    shuffles of 8-lane vectors: pairs of rows joined (an insert), 4 rows to 2 half-transposed vectors
    (a two-source permute each), 8 rows to one vector per position (a 128-bit lane shuffle each)."""
    z = [builder.shuffle_vector(rows[j], rows[j + 1], _mask(list(range(8)))) for j in range(0, len(rows), 2)]
    u, v = [], []
    for h in range(0, len(z), 2):  # rows 2h .. 2h + 3: [a0 b0 c0 d0 a1 b1 c1 d1], [a2 b2 c2 d2 a3 b3 c3 d3]
        u.append(builder.shuffle_vector(z[h], z[h + 1], _mask([0, 4, 8, 12, 1, 5, 9, 13])))
        v.append(builder.shuffle_vector(z[h], z[h + 1], _mask([2, 6, 10, 14, 3, 7, 11, 15])))
    lo, hi = _mask([0, 1, 2, 3, 8, 9, 10, 11]), _mask([4, 5, 6, 7, 12, 13, 14, 15])
    pos: list[list] = [[], [], [], []]  # type: ignore[type-arg]
    for o in range(0, len(u), 2):  # rows 4o .. 4o + 7
        pos[0].append(builder.shuffle_vector(u[o], u[o + 1], lo))
        pos[1].append(builder.shuffle_vector(u[o], u[o + 1], hi))
        pos[2].append(builder.shuffle_vector(v[o], v[o + 1], lo))
        pos[3].append(builder.shuffle_vector(v[o], v[o + 1], hi))
    return _concat(builder, [x for p in pos for x in p])


@intrinsic(prefer_literal=True)
def load_cols(typingctx, arr, base, stride, i, g):  # type: ignore[no-untyped-def]
    ints = all(isinstance(t, types.Integer) for t in (base, stride, i))
    if not (_is_u64_array(arr) and ints and isinstance(g, types.IntegerLiteral)):
        return None
    rows = g.literal_value
    if rows < 1 or rows & (rows - 1):
        return None
    vt = Vec(4 * rows)

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        base_, stride_, i_ = (context.cast(builder, v, t, types.intp) for v, t in zip(args[1:4], sig.args[1:4]))
        start = builder.add(base_, i_)
        parts = [
            builder.load(
                _vec_ptr(context, builder, sig.args[0], args[0], builder.add(start, builder.mul(stride_, ir.Constant(stride_.type, k))), 4),
                align=8,
            )
            for k in range(rows)
        ]
        if rows % 8 == 0:  # 24 shuffles per 64 lanes where LLVM's lowering of the one shuffle below takes 32
            return _transpose_staged(builder, parts)
        while len(parts) > 1:  # concatenate the rows: element 4k + p is row k, lane p
            m = 2 * parts[0].type.count
            parts = [builder.shuffle_vector(parts[j], parts[j + 1], _mask(list(range(m)))) for j in range(0, len(parts), 2)]
        whole = parts[0]
        return builder.shuffle_vector(whole, whole, _mask([4 * k + p for p in range(4) for k in range(rows)]))

    return vt(arr, base, stride, i, g), codegen



@intrinsic
def prefetch(typingctx, arr, i):  # type: ignore[no-untyped-def]
    """A hint to bring the cache line holding ``arr[i]`` into the caches (no fault, no effect on values)."""
    if not (_is_u64_array(arr) and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        index = context.cast(builder, args[1], sig.args[1], types.intp)
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [index]), ir.IntType(8).as_pointer())
        fnty = ir.FunctionType(ir.VoidType(), [ptr.type, _I32, _I32, _I32])
        fn = builder.module.declare_intrinsic("llvm.prefetch", [ptr.type], fnty)
        builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return types.none(arr, i), codegen
