"""Static check of the triton-ascend rules (docs/ops.md) over every Triton kernel under verl_moe.ops.

Each module that defines kernels publishes `KERNEL_LAUNCHES = {kernel name: spec}`, where spec holds
the values its launcher really uses: "configs" (the autotune list; the first one under the
interpreter), "meta" (shape -> tile constexprs), "runtime" (shape -> runtime sizes the grid
needs), "grid" (meta -> launch grid) and "max_shapes" (the documented largest shapes). The check
evaluates grids and tile sizes at those shapes and reads each kernel's source (AST):

- every kernel is declared; grids are 1-D with at most 65535 programs at the documented maxima;
- tile constexprs (B*, BLOCK_*) and every tl.arange length are powers of two; K/V tiles <= 128;
- each tl.zeros/tl.full tile holds <= 128 x 128 elements and all of a kernel's together <= 192 KiB
  at 4 bytes (Ascend's unified buffer), a lower bound of its live tiles;
- no tl.atomic_* (determinism); no tl.permute / .T, and tl.trans only of tiles the spec declares
  under "trans" ({name: shape}) with at most 64 x 64 elements (transposes are copies on Ascend);
- tl.program_id / tl.num_programs only on axis 0; `if` only on constexprs and module constants;
- tl.dot names its input_precision (fp32 inputs must not drop to TF32), and a name passed as the
  left tl.dot operand (or `name.to(...)`, which may alias it) is not read again before it is
  reassigned: Ascend's tl.dot may overwrite its left operand.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import pkgutil
import re
import textwrap

import pytest
from verl_moe.ops import device

if not device.is_accelerator():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # kernels decorate the same way as in the op tests

import triton  # noqa: E402
import verl_moe.ops  # noqa: E402

GRID_LIMIT = 65535
TILE_NAME = re.compile(r"^(B[A-Z]{1,3}|BLOCK(_[A-Z0-9]+)*)$")
KV_TILE_NAME = re.compile(r"^(B|BLOCK_?)(K|V)[A-Z]*$")
MAX_TILE_ELEMENTS = 128 * 128
MAX_TRANS_ELEMENTS = 64 * 64
UB_BYTES = 192 * 1024


def _jit_types():
    types = [triton.runtime.jit.JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction

        types.append(InterpretedFunction)
    except ImportError:
        pass
    return tuple(types)


def _unwrap(obj):
    """The plain Python function under a jit function or an autotuner/heuristics wrapper, else None."""
    jit_types = _jit_types()
    for _ in range(4):
        if isinstance(obj, jit_types):
            return obj.fn
        obj = getattr(obj, "fn", None)
        if obj is None:
            return None
    return None


def _kernel_modules():
    """{module: {name: python function}} for every verl_moe.ops module defining Triton kernels."""
    found = {}
    for info in pkgutil.walk_packages(verl_moe.ops.__path__, "verl_moe.ops."):
        if info.name.rsplit(".", 1)[-1].startswith("_") and not info.ispkg:
            continue  # private scripts (e.g. diagnostics that run at import) are not kernel modules
        module = importlib.import_module(info.name)
        fns = {}
        for obj in vars(module).values():
            fn = _unwrap(obj)
            if fn is not None and fn.__module__ == module.__name__:
                fns[fn.__name__] = fn
        if fns:
            found[module] = fns
    return found


MODULES = _kernel_modules()
ALL_FNS = {name: fn for fns in MODULES.values() for name, fn in fns.items()}


def _tree(fn) -> ast.FunctionDef:
    return ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]


def _is_tl_call(node, names) -> bool:
    f = node.func if isinstance(node, ast.Call) else None
    return isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "tl" and f.attr in names


def _constexpr_params(tree: ast.FunctionDef) -> set[str]:
    return {a.arg for a in tree.args.args if a.annotation is not None and "constexpr" in ast.unparse(a.annotation)}


def _called_names(tree) -> set[str]:
    return {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


def _launched(fns: dict) -> dict:
    """Kernels launched from the host: jit functions no jit function under verl_moe.ops calls."""
    helpers = set().union(*(_called_names(_tree(fn)) for fn in ALL_FNS.values()))
    return {name: fn for name, fn in fns.items() if name not in helpers}


def _evaluate(node, env: dict):
    """Integer value of a tile-shape expression (names, ints, + - * //), or raise KeyError."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        value = env[node.id]
        if not isinstance(value, int):
            raise KeyError(node.id)
        return value
    if isinstance(node, ast.BinOp):
        a, b = _evaluate(node.left, env), _evaluate(node.right, env)
        ops = {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b}
        if isinstance(node.op, ast.FloorDiv):
            return a // b
        if type(node.op) in ops:
            return ops[type(node.op)]
    raise KeyError(ast.unparse(node))


def _pow2(x) -> bool:
    return isinstance(x, int) and x > 0 and x & (x - 1) == 0


def _envs(module, spec):
    """Every (shape, meta, config) combination a launcher can use at the documented maxima."""
    constants = {k: v for k, v in vars(module).items() if isinstance(v, int) and not isinstance(v, bool)}
    for shape in spec["max_shapes"]:
        meta = spec["meta"](shape)
        for config in spec["configs"]:
            yield {**constants, **shape, **spec["runtime"](shape), **meta, **config}, meta, config


CASES = [(m.__name__, name) for m, fns in MODULES.items() for name in _launched(fns)]


def test_kernels_are_found():
    names = {name for _, name in CASES}
    assert {"_gdn_solve_fwd_kernel", "_gdn_state_fwd_kernel", "_gdn_wy_bwd_kernel"} <= names, names


@pytest.mark.parametrize("module_name,kernel", CASES, ids=[f"{m.split('.')[-1]}.{k}" for m, k in CASES])
def test_kernel_follows_ascend_rules(module_name, kernel):
    module = importlib.import_module(module_name)
    fns = ALL_FNS
    specs = getattr(module, "KERNEL_LAUNCHES", {})
    assert kernel in specs, (
        f"{module_name}.{kernel} has no KERNEL_LAUNCHES entry (configs, meta, runtime, grid, max_shapes)"
    )
    spec = specs[kernel]
    source = inspect.getsource(module)
    for key in ("grid", "meta", "runtime"):
        fn_name = getattr(spec[key], "__name__", "<lambda>")
        if fn_name != "<lambda>":
            assert source.count(fn_name) >= 2, f"{fn_name} is declared for {kernel} but no launcher uses it"
    errors = []
    # The kernel and the helpers it calls, transitively.
    todo, trees = [kernel], {}
    while todo:
        name = todo.pop()
        if name in trees or name not in fns:
            continue
        trees[name] = _tree(fns[name])
        todo += list(_called_names(trees[name]))
    for env, meta, config in _envs(module, spec):
        grid = spec["grid"](env)
        if len(grid) != 1 or not 1 <= grid[0] <= GRID_LIMIT:
            errors.append(f"grid {grid} at {config} is not 1-D within {GRID_LIMIT}")
        for key, value in {**meta, **config}.items():
            if TILE_NAME.match(key) and not _pow2(value):
                errors.append(f"tile {key}={value} is not a power of two")
            if KV_TILE_NAME.match(key) and value > 128:
                errors.append(f"tile {key}={value} > 128")
        for name, tree in trees.items():
            errors += _tile_errors(name, tree, env)
        for tile, shape in spec.get("trans", {}).items():
            count = 1
            for d in shape:
                count *= env[d] if isinstance(d, str) else d
            if count > MAX_TRANS_ELEMENTS:
                errors.append(f"declared transpose of {tile} {shape} = {count} elements > {MAX_TRANS_ELEMENTS}")
    for name, tree in trees.items():
        errors += _ast_errors(name, tree, set(vars(module)), trans_ok=set(spec.get("trans", {})))
    assert not errors, f"{module_name}.{kernel}:\n  " + "\n  ".join(sorted(set(errors)))


def _tile_errors(name, tree, env) -> list[str]:
    errors, total = [], 0
    for node in ast.walk(tree):
        try:
            if _is_tl_call(node, {"arange"}):
                start, end = (_evaluate(a, env) for a in node.args[:2])
                if not _pow2(end - start):
                    errors.append(f"{name}: {ast.unparse(node)} has length {end - start}, not a power of two")
            if _is_tl_call(node, {"zeros", "full"}):
                shape = node.args[0] if node.args else node.keywords[0].value
                if isinstance(shape, (ast.List, ast.Tuple)):
                    dims = [_evaluate(d, env) for d in shape.elts]
                    count = 1
                    for d in dims:
                        count *= d
                    total += count * 4
                    if count > MAX_TILE_ELEMENTS:
                        errors.append(f"{name}: {ast.unparse(node)} holds {count} elements > {MAX_TILE_ELEMENTS}")
        except KeyError as e:
            errors.append(f"{name}: cannot evaluate {ast.unparse(node)} ({e}); declare it in meta/config")
    if total > UB_BYTES:
        errors.append(f"{name}: tl.zeros/tl.full tiles take {total} bytes > {UB_BYTES}")
    return errors


def _ast_errors(name, tree, module_names, trans_ok=frozenset()) -> list[str]:
    errors = []
    allowed_if = _constexpr_params(tree) | module_names | {"tl", "triton", "True", "False", "None"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("atomic_"):
            errors.append(f"{name}: {ast.unparse(node)} (atomics break determinism)")
        declared = _is_tl_call(node, {"trans"}) and isinstance(node.args[0], ast.Name) and node.args[0].id in trans_ok
        if not declared and (
            _is_tl_call(node, {"trans", "permute"}) or (isinstance(node, ast.Attribute) and node.attr == "T")
        ):
            errors.append(
                f"{name}: {ast.unparse(node)} (transposes are copies on Ascend: load transposed or declare it)"
            )
        if _is_tl_call(node, {"program_id", "num_programs"}):
            axis = node.args[0] if node.args else node.keywords[0].value
            if not (isinstance(axis, ast.Constant) and axis.value == 0):
                errors.append(f"{name}: {ast.unparse(node)} (grids are 1-D)")
        if isinstance(node, ast.If):
            used = {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
            if not used <= allowed_if:
                errors.append(
                    f"{name}: `if {ast.unparse(node.test)}` depends on runtime values {sorted(used - allowed_if)}"
                )
        if _is_tl_call(node, {"dot"}) and not any(k.arg == "input_precision" for k in node.keywords):
            errors.append(f"{name}: {ast.unparse(node)} has no input_precision")
    clobber_errors = []
    _clobber_errors(tree.body, set(), clobber_errors)
    return errors + [f"{name}: {e}" for e in clobber_errors]


def _dot_left_name(node) -> str | None:
    """The name a tl.dot may overwrite: its left operand `x` or `x.to(...)`."""
    left = node.args[0] if node.args else None
    if isinstance(left, ast.Call) and isinstance(left.func, ast.Attribute) and left.func.attr == "to":
        left = left.func.value
    return left.id if isinstance(left, ast.Name) else None


def _reads(stmt) -> set[str]:
    """Names whose data a statement reads (`x.dtype` / `x.shape` read no data)."""
    meta_only = {id(n.value) for n in ast.walk(stmt) if isinstance(n, ast.Attribute) and n.attr in ("dtype", "shape")}
    return {
        n.id
        for n in ast.walk(stmt)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and id(n) not in meta_only
    }


def _writes(stmt) -> set[str]:
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
    names = set()
    for t in targets:
        if t is not None and not isinstance(stmt, ast.AugAssign):
            names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def _clobber_errors(stmts, clobbered=None, errors=None):
    """Walk statements in program order (loop bodies twice) tracking names a tl.dot may have overwritten."""
    clobbered = set() if clobbered is None else clobbered
    errors = [] if errors is None else errors
    for stmt in stmts:
        if isinstance(stmt, (ast.For, ast.While)):
            for _ in range(2):
                clobbered = _clobber_errors(stmt.body, clobbered, errors)
        elif isinstance(stmt, ast.If):
            # A branch that ends in `return` hands nothing on to the statements after the `if`.
            branches = [
                _clobber_errors(body, set(clobbered), errors)
                for body in (stmt.body, stmt.orelse)
                if not (body and isinstance(body[-1], ast.Return))
            ]
            clobbered = set().union(*branches)
        else:
            for n in sorted(_reads(stmt) & clobbered):
                msg = f"`{n}` is read after being a left tl.dot operand: {ast.unparse(stmt)[:80]}"
                if msg not in errors:
                    errors.append(msg)
            dotted = {_dot_left_name(n) for n in ast.walk(stmt) if _is_tl_call(n, {"dot"})} - {None}
            clobbered = (clobbered | dotted) - _writes(stmt)
    return clobbered


def test_checker_catches_broken_kernels():
    """The AST rules fire on a kernel that breaks each of them (the checker is not vacuous)."""
    src = textwrap.dedent(
        """
        def bad(x, n, BK: tl.constexpr):
            i = tl.program_id(1)
            b = tl.load(x)
            c = tl.dot(b, b)
            d = b + 1
            tl.atomic_add(x, d)
            if n > 0:
                e = tl.trans(c)
        """
    )
    errors = _ast_errors("bad", ast.parse(src).body[0], set())
    text = "\n".join(errors)
    for needle in ("grids are 1-D", "atomics", "transposes", "runtime values", "input_precision", "read after"):
        assert needle in text, (needle, text)
    env = {"BK": 96, "BT": 64}
    tile = ast.parse(
        "def k(BK: tl.constexpr):\n    a = tl.arange(0, BK)\n    z = tl.zeros([256, 256], dtype=tl.float32)"
    ).body[0]
    text = "\n".join(_tile_errors("k", tile, env))
    assert "not a power of two" in text and "elements" in text, text
