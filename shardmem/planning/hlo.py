"""Reading what XLA says about a compiled program: FLOPs from the jaxpr, every buffer over the step's schedule
(and so what is live at the peak) from the compiler's buffer assignment, and collective traffic from the
optimized HLO.

These are the parts of the memory report that :meth:`jax.stages.Compiled.memory_analysis` does not give.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from jax.extend import core as jex_core

from shardmem.parallel.schedule import ONE_OF_SCOPE

# --- FLOPs ---------------------------------------------------------------------------------------


def matmul_flops(
    jaxpr,
    op_shares: Mapping[int, float] | None = None,
    *,
    recomputed: bool = True,
    used: Sequence[bool] | None = None,
) -> float:
    """Returns the FLOPs of every ``dot_general`` and convolution in a (closed) jaxpr, counting scan trip
    counts and the recomputation that remat adds to the backward pass (it appears as extra ops there),
    the matmuls inside fused attention kernels (:func:`fused_attention_flops`), and ``shard_map`` bodies
    once per shard; not those whose results nothing uses (XLA removes them), ``used`` saying which of
    the jaxpr's outputs are (default: all). ``recomputed=False`` leaves out what fused attention kernels
    recompute in their backward (a ``jax.checkpoint``'s recomputation is left out by tracing the step
    without it): the model's FLOPs, as MFU counts them. Of loops a device runs one of (a 1F1B tick's ops,
    :func:`one_of_groups`) the costliest counts, or, given ``op_shares`` (the share of a schedule's ticks
    and stages that runs each op: :attr:`~shardmem.parallel.pipeline.Pipeline.op_shares`), each op its
    share."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)

    def count(sub) -> float:
        return matmul_flops(sub, op_shares, recomputed=recomputed)

    total = 0.0
    live = _live_eqns(jaxpr, used)
    loops = [(eqn, str(eqn.source_info.name_stack)) for eqn, _ in live if eqn.primitive.name == "while"]
    groups = _one_of_runs(loops)
    for group in groups:
        flops = {_eqn_one_of_index(eqn): sum(count(sub) for sub in _sub_jaxprs(eqn.params)) for eqn in group}
        if op_shares is None:
            total += max(flops.values())
        else:
            total += sum(op_shares.get(op, 0.0) * value for op, value in flops.items())
    grouped = {id(eqn) for group in groups for eqn in group}
    for eqn, outputs_used in live:
        if id(eqn) in grouped:
            continue
        name = eqn.primitive.name
        fused = fused_attention_flops(eqn, recomputed=recomputed)
        if fused is not None:
            total += fused
            continue
        if name == "dot_general":
            (contracting, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            k = math.prod(lhs[d] for d in contracting)
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * k
            continue
        if name == "conv_general_dilated":
            # Each output element is a dot over the kernel's spatial window and its input features
            # (per feature group): 2 x output size x kernel elements / output features.
            rhs = eqn.invars[1].aval.shape
            out_features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(rhs) / out_features
            continue
        subs = list(_sub_jaxprs(eqn.params))
        if name == "cond":  # One branch runs: the costliest.
            inner = max((count(b) for b in eqn.params["branches"]), default=0.0)
        elif name in _BODY_CALLS and len(subs) == 1:  # Its outputs are its body's: unused ones stay unused.
            inner = matmul_flops(subs[0], op_shares, recomputed=recomputed, used=outputs_used)
        else:
            inner = sum(count(sub) for sub in subs)
        if name == "scan":
            inner *= eqn.params["length"]
        elif name == "shard_map":  # The body sees one shard; count every distinct shard once.
            inner *= _shards(eqn.params)
        total += inner
    return total


#: Primitives that run one jaxpr whose outputs are theirs, one for one.
_BODY_CALLS = {"pjit", "jit", "closed_call", "core_call", "shard_map", "checkpoint", "remat", "remat2"}


def _live_eqns(jaxpr, used: Sequence[bool] | None = None) -> list:
    """``(equation, which of its outputs are used)`` for the equations of ``jaxpr`` whose results are used
    (by its outputs, ``used`` saying which, or a used equation) or that have effects: XLA removes the
    rest, such as the forward matmul that ``jax.vjp`` traces inside a ``custom_vjp`` rule for a pullback
    alone, or a gradient nobody asked for (:mod:`shardmem.parallel.collective_matmul`)."""
    outputs = jaxpr.outvars if used is None else [v for v, u in zip(jaxpr.outvars, used, strict=True) if u]
    needed = {id(v) for v in outputs if not hasattr(v, "val")}  # Literals carry a value.
    live = []
    for eqn in reversed(jaxpr.eqns):
        outputs_used = [id(v) in needed for v in eqn.outvars]
        if eqn.effects:
            outputs_used = [True] * len(eqn.outvars)
        if any(outputs_used):
            live.append((eqn, outputs_used))
            needed.update(id(v) for v in eqn.invars if not hasattr(v, "val"))
    return live[::-1]


#: JAX's Pallas flash-attention kernels (jax.experimental.pallas.ops.gpu.attention), by pallas_call name.
_PALLAS_ATTENTION = ("mha_forward", "mha_backward")
#: The serving decode step's Pallas kernel over the stacked KV cache (shardmem.models.decode_attention).
DECODE_ATTENTION = "decode_attention"
_FUSED_PALLAS = (*_PALLAS_ATTENTION, DECODE_ATTENTION)


@dataclasses.dataclass(frozen=True)
class FusedKernel:
    """What the compiled program cannot say of a fused attention kernel, read from its jaxpr: its
    ``matmuls`` per query-key pair, whether it is ``causal``; for the decode kernel (``decode``), the
    sliding ``window`` it reads at most (None: every position of the cache)."""

    matmuls: int
    causal: bool
    decode: bool = False
    window: int | None = None


#: cuDNN's fused attention primitives, and the matmuls each runs per (query, key) pair: QK and PV forward;
#: the backward recomputes QK and makes dP, dV, dQ and dK.
_CUDNN_ATTENTION = {"dot_product_attention_fwd_wrapper": 2, "dot_product_attention_bwd_wrapper": 5}
#: The matmuls per (query, key) pair of an attention backward that recomputes nothing: dP, dV, dQ and dK.
_BACKWARD_MATMULS = 4


def fused_attention_flops(eqn, *, recomputed: bool = True) -> float | None:
    """Returns the FLOPs of a fused attention kernel's matmuls, or None when ``eqn`` is not one.

    The jaxpr shows such a kernel as one opaque op, so they are counted from its shapes: each matmul of
    queries against keys costs ``2 x B x heads x Lq x Lk x head_dim``, half of it for a causal kernel
    (the blocks above the diagonal are skipped). A Pallas kernel's matmuls are the ``dot_general``s of its
    body (2 forward, 7 backward: the backward recomputes the scores once for dK/dV and once for dQ), and
    it is causal when its body compares query and key positions. ``recomputed=False`` counts a backward
    kernel's 4 matmuls that recompute nothing (dP, dV, dQ, dK)."""
    name = eqn.primitive.name
    if name == "pallas_call" and eqn.params.get("name") == DECODE_ATTENTION:
        return decode_flops(_pallas_kernel(eqn), eqn.invars[0].aval.shape, eqn.invars[1].aval.shape)
    if name == "pallas_call" and eqn.params.get("name") in _PALLAS_ATTENTION:
        kernel = _pallas_kernel(eqn)
        matmuls, causal = kernel.matmuls, kernel.causal
        q, k = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape  # [B, L, heads, head_dim]
        if not recomputed and eqn.params["name"] == "mha_backward":
            matmuls = _BACKWARD_MATMULS
    elif name in _CUDNN_ATTENTION:
        matmuls = _CUDNN_ATTENTION[name]
        if not recomputed and name.endswith("_bwd_wrapper"):
            matmuls = _BACKWARD_MATMULS
        causal = "CAUSAL" in str(eqn.params.get("mask_type", ""))
        q, k = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape  # [B, T, heads, head_dim] (BTNH)
    else:
        return None
    pairs = q[0] * q[2] * q[1] * k[1] * q[3]
    return matmuls * 2.0 * pairs * (0.5 if causal else 1.0)


def decode_flops(kernel: FusedKernel, q_shape, keys_shape) -> float:
    """The decode kernel's FLOPs: its queries ``[B, G, R, K]`` against the positions it reads of the
    stacked cache's keys ``[layers, B, T, G, K]``."""
    return kernel.matmuls * 2.0 * math.prod(q_shape) * decode_positions(kernel, keys_shape[2])


def decode_positions(kernel: FusedKernel, max_len: int) -> int:
    """Positions of each sequence the decode kernel reads when the cache's ``max_len`` are live: all, or
    its window's."""
    return max_len if kernel.window is None else min(max_len, kernel.window)


def fused_attention_kernels(jaxpr, _scopes: tuple[str, ...] = ()) -> dict[str, FusedKernel]:
    """Returns the Pallas flash-attention kernels of a (closed) jaxpr, each with its matmuls per query-key
    pair and whether it is causal: what the optimized HLO's custom calls cannot say. Each is keyed by its
    name ("mha_forward") and by its innermost named scope and name ("causal_block/mha_forward"): a causal
    and an unmasked kernel share a name (a split sequence's blocks), and the scope tells them apart
    (:func:`attention_kernel` reads the keys back from an op name)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    kernels = {}
    for eqn in jaxpr.eqns:
        scopes = _scopes + _plain_scopes(str(eqn.source_info.name_stack))
        if eqn.primitive.name == "pallas_call" and eqn.params.get("name") in _FUSED_PALLAS:
            name, kernel = eqn.params["name"], _pallas_kernel(eqn)
            kernels[name] = kernel
            enclosing = [scope for scope in scopes if scope != name]
            if enclosing:
                kernels[f"{enclosing[-1]}/{name}"] = kernel
        for sub in _sub_jaxprs(eqn.params):
            kernels.update(fused_attention_kernels(sub, scopes))
    return kernels


def attention_kernel(op_name: str, kernels: dict[str, FusedKernel]) -> FusedKernel | None:
    """The entry of :func:`fused_attention_kernels` that a compiled kernel's ``op_name`` names: its
    innermost kernel name, under the nearest named scope that has an entry, else by the name alone."""
    scopes = _plain_scopes(op_name)
    for index in range(len(scopes) - 1, -1, -1):
        name = scopes[index]
        if name not in kernels:
            continue
        for scope in reversed(scopes[:index]):
            if f"{scope}/{name}" in kernels:
                return kernels[f"{scope}/{name}"]
        return kernels[name]
    return None


def _plain_scopes(name_stack: str) -> tuple[str, ...]:
    """The named scopes of a name stack or op name, transformations (``jvp(...)``, ``jit(...)``) and
    control flow (``while``, ``body``) left out: what a jaxpr and its compiled program both show."""
    scopes = []
    for part in map(_unwrapped, name_stack.split("/")):
        if part and part not in _NOISE and "(" not in part:
            scopes.append(part)
    return tuple(scopes)


def _pallas_kernel(eqn) -> FusedKernel:
    """A Pallas attention kernel's :class:`FusedKernel`: the ``dot_general``s of its body, and whether the
    body compares query and key positions; the decode kernel's window from its metadata."""
    body = eqn.params["jaxpr"]
    matmuls = _count_primitive(body, "dot_general")
    if eqn.params.get("name") == DECODE_ATTENTION:
        metadata = dict(eqn.params.get("metadata") or {})  # A FrozenDict: its get takes no default.
        window = int(metadata.get("window", 0)) or None
        return FusedKernel(matmuls, False, decode=True, window=window)
    return FusedKernel(matmuls, _count_primitive(body, "ge") > 0)


def _count_primitive(jaxpr, primitive: str) -> int:
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    return sum((eqn.primitive.name == primitive) + sum(_count_primitive(sub, primitive)
               for sub in _sub_jaxprs(eqn.params)) for eqn in jaxpr.eqns)  # fmt: skip


def _shards(params) -> int:
    """The number of distinct shards a ``shard_map`` (its equation's ``params``) computes: the sizes of the
    mesh axes it splits by hand that its inputs are split over, or whose index its body reads (a
    sequence split by hand takes each device's chunk so); the other axes repeat the same work."""
    mesh, axes = params["mesh"], set()
    for spec in params["in_specs"]:
        for entry in spec or ():
            axes.update(entry if isinstance(entry, tuple) else (entry,) if entry else ())
    axes |= _indexed_axes(params["jaxpr"])
    # The axes this shard_map makes manual (a nested one: only those its enclosing one left to XLA).
    names = ("newly_manual_axes", "manual_axes", "axis_names")
    manual = next((params[name] for name in names if params.get(name) is not None), None)
    return math.prod(mesh.shape[a] for a in axes if manual is None or a in manual)


def _indexed_axes(jaxpr) -> set[str]:
    """The mesh axes a (closed) jaxpr reads its device's index along (``lax.axis_index``)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    axes = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "axis_index":
            name = eqn.params["axis_name"]
            axes.update(name if isinstance(name, tuple) else (name,))
        for sub in _sub_jaxprs(eqn.params):
            axes |= _indexed_axes(sub)
    return axes


#: ``jax.checkpoint``'s primitive, by its names across JAX versions.
_REMAT_PRIMITIVES = {"checkpoint", "remat", "remat2"}


def remat_count(jaxpr) -> int:
    """Returns how many ``jax.checkpoint`` (remat) calls a (closed) jaxpr makes, scan bodies counted once:
    0 means the traced step recomputes nothing, whatever a plan asked for."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    return sum((eqn.primitive.name in _REMAT_PRIMITIVES) + sum(remat_count(sub)
               for sub in _sub_jaxprs(eqn.params)) for eqn in jaxpr.eqns)  # fmt: skip


def checkpoint_tags(jaxpr) -> set[str]:
    """Returns the names given with ``checkpoint_name`` anywhere in a (closed) jaxpr."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    tags = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name" and "name" in eqn.params:
            tags.add(str(eqn.params["name"]))
        for sub in _sub_jaxprs(eqn.params):
            tags |= checkpoint_tags(sub)
    return tags


def _sub_jaxprs(params):
    for value in params.values():
        items = value if isinstance(value, list | tuple) else (value,)
        for item in items:
            if isinstance(item, jex_core.ClosedJaxpr | jex_core.Jaxpr):
                yield item


# --- Buffers live at the peak --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LiveBuffer:
    """One allocation live at the peak: its size, the model scope that made it, and its shape."""

    bytes: int
    scope: str
    shape: str


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+) = (?P<rest>.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_NOISE = {"while", "body", "closed_call", "checkpoint", "remat", "remat2", "rematted_computation", "pjit",
          "cond", "branch_0", "branch_1", "core_call", "custom_jvp_call", "custom_vjp_call"}  # fmt: skip


def _split_shape(rest: str) -> tuple[str, str]:
    """Splits "(f32[2], s32[]) while(...)" into the shape text and the remainder."""
    if not rest.startswith("("):
        shape, _, remainder = rest.partition(" ")
        return shape, remainder
    depth = 0
    for i, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return rest[: i + 1], rest[i + 1 :]
    return rest, ""


def _tuple_element(shape: str, index: str) -> str:
    """Returns element ``index`` ("1,0": nested) of a tuple shape, without comments and layouts:
    ("(f32[2]{0}, /*index=1*/bf16[3,4]{1,0})", "1") -> "bf16[3,4]"."""
    shape = re.sub(r"/\*.*?\*/", "", shape)  # XLA numbers long tuples' elements: /*index=5*/.
    for i in (int(x) for x in index.split(",") if x.strip()):
        if not shape.startswith("("):
            break
        parts, depth, start = [], 0, 1
        for j, ch in enumerate(shape):
            depth += ch in "([{"
            depth -= ch in ")]}"
            if ch == "," and depth == 1:
                parts.append(shape[start:j].strip())
                start = j + 1
        parts.append(shape[start:-1].strip())
        shape = parts[i] if i < len(parts) else shape
    return re.sub(r"\{[^}]*\}", "", shape)  # Drop layouts: f32[2,3]{1,0} -> f32[2,3].


def readable_scope(op_name: str) -> str:
    """Turns "jit(step)/while/body/transpose(jvp(layers_0-7))/attention/dot_general" into
    "layers_0-7/attention/dot_general (backward)" (a nested function's "jit(run_layer)" left out too),
    and an argument's "state['params']['layers']['wq']" into "state/params/layers/wq (argument)"."""
    if op_name == "loop or call carried state":
        return op_name
    if re.fullmatch(r"[\w\-]+\.\d+", op_name):  # "broadcast.101": an instruction XLA created.
        return f"{op_name} (made by XLA)"
    if not op_name.startswith("jit("):
        return "/".join(re.findall(r"[A-Za-z_][\w.\-]*|\d+", op_name)) + " (argument)"
    backward = "transpose(" in op_name
    parts = []
    for part in map(_unwrapped, op_name.split("/")[1:]):
        if part and part not in _NOISE and not part.startswith("jit("):  # A nested jit is no model scope.
            parts.append(part)
    scope = "/".join(parts) or "loop body (no model scope)"
    return f"{scope} (backward)" if backward else scope


def _unwrapped(part: str) -> str:
    """A name-stack part without the transformations around it: "transpose(jvp(mlp))" -> "mlp"."""
    while match := re.fullmatch(r"(?:transpose|jvp|vmap|remat|checkpoint)\((.*)\)", part):
        part = match.group(1)
    return part


_CALLED = re.compile(r"calls=%?([\w.\-]+)")
_OPERAND = re.compile(r"%?([\w.\-]+)")


def _instructions(hlo_text: str) -> dict[str, tuple[str, str]]:
    """Maps instruction name -> (shape text, op_name) for every instruction in an HLO module.

    Instructions XLA created without metadata borrow it: a fusion from the computation it calls, a
    loop's parameter is named as the loop's carried state, anything else from its first operand that
    has a name (shown as "from ..."). A scan's stacked residual (the ``dynamic_update_slice`` that stores
    one layer's value into the stack) is named by the op that made the stored value, marked "stacked "."""
    table: dict[str, tuple[str, str]] = {}
    calls: dict[str, str] = {}
    operands: dict[str, list[str]] = {}
    opcodes: dict[str, str] = {}
    parameters: dict[str, int] = {}  # parameter instruction -> its index
    roots: dict[str, str] = {}  # computation -> its ROOT instruction
    unnamed: list[str] = []
    first_op: dict[str, str] = {}
    current = ""
    for line in hlo_text.splitlines():
        if not line.startswith(" ") and line.rstrip().endswith("{"):
            header = _COMPUTATION.match(line)
            current = header.group(1) if header else ""
            continue
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name = match.group("name")
        shape, remainder = _split_shape(match.group("rest"))
        op = _OP_NAME.search(remainder)
        op_name = op.group(1) if op else ""
        opcode, _, args = remainder.strip().partition("(")
        opcodes[name] = opcode
        operands[name] = _OPERAND.findall(re.sub(r"/\*.*?\*/", "", args.split(")", 1)[0]))
        called = _CALLED.search(remainder)
        if called:
            calls[name] = called.group(1)
        if opcode == "parameter":
            parameters[name] = int(args.split(")", 1)[0] or 0)
        if line.lstrip().startswith("ROOT"):
            roots[current] = name
        if op_name and current:
            first_op.setdefault(current, op_name)
        if not op_name:
            if opcode == "parameter" and not current.startswith("main"):
                op_name = "loop or call carried state"
            elif not called:
                unnamed.append(name)
        table[name] = (shape, op_name)
    for name, computation in calls.items():
        if not table[name][1]:
            table[name] = (table[name][0], first_op.get(computation, ""))
    for name in unnamed:  # Still unnamed: borrow from an operand.
        near = next((table[a][1] for a in operands[name] if a in table and table[a][1]), "")
        near = "" if near.startswith("near ") else near
        table[name] = (table[name][0], f"near {near}" if near else "")
    for name, (shape, op_name) in table.items():
        if op_name.endswith(_STACKING):
            made_by = _stored_value(name, opcodes, operands, calls, roots, parameters, table)
            if made_by:
                table[name] = (shape, f"stacked {made_by}")
    return table


#: The op_name ending of the update that stacks one scan iteration's value (a residual) into its output.
_STACKING = "jit(dynamic_update_index_in_dim)/dynamic_update_slice"
#: Ops that pass a value through unchanged in content, followed back to the op that made it.
_PASS_THROUGH = {"bitcast", "copy", "reshape", "convert", "transpose", "broadcast"}


def _stored_value(name, opcodes, operands, calls, roots, parameters, table) -> str:
    """Returns the op_name of the instruction that made the value a (fused) dynamic-update-slice stores,
    following it through bitcasts and copies and out of the fusion; "" when it cannot be told."""
    fusion = name if opcodes.get(name) == "fusion" else None
    update = roots.get(calls.get(name, ""), "") if fusion else name
    if opcodes.get(update) != "dynamic-update-slice" or len(operands.get(update, ())) < 2:
        return ""
    value = operands[update][1]
    for _ in range(16):
        opcode = opcodes.get(value)
        if opcode == "parameter" and fusion and parameters.get(value, -1) < len(operands[fusion]):
            value, fusion = operands[fusion][parameters[value]], None  # Out of the fusion, to its operand.
        elif opcode in _PASS_THROUGH and operands.get(value):
            value = operands[value][0]
        else:
            break
    if opcodes.get(value) == "get-tuple-element" and opcodes.get(operands[value][0]) == "parameter":
        # A value the loop carries into the iteration: the scan's carry, i.e. the layer's input.
        return table[name][1].removesuffix(_STACKING) + "layer input"
    op_name = table.get(value, ("", ""))[1]
    stacked = op_name.endswith(_STACKING) or op_name.startswith("near ") or not op_name.startswith("jit(")
    return "" if stacked else op_name


# Scope -> the category a timeline stacks it under, first match wins.
CATEGORIES = ("arguments", "attention", "mlp", "layers (other)", "optimizer update", "loop carried state",
              "other")  # fmt: skip


def category(scope: str) -> str:
    """Returns the timeline category of a readable scope ("layers_0-7/attention/dot" -> "attention")."""
    if scope.endswith("(argument)"):
        return "arguments"
    if "optimizer_update" in scope:
        return "optimizer update"
    for name in ("attention", "mlp"):
        if name in scope:
            return name
    if scope.startswith(("layers_", "from layers_", "pipeline", "from pipeline")):  # Pipelined layers too.
        return "layers (other)"
    if scope == "loop or call carried state":
        return "loop carried state"
    return "other"


@dataclasses.dataclass(frozen=True)
class ScheduledBuffer:
    """One buffer of the compiled step: ``bytes`` of one XLA allocation (at one offset), live from schedule
    position ``start`` to ``end`` (inclusive), attributed to the scope that made it."""

    bytes: int
    scope: str
    shape: str
    start: int
    end: int

    @property
    def category(self) -> str:
        return category(self.scope)


@dataclasses.dataclass(frozen=True)
class BufferSchedule:
    """Every buffer of a compiled step over its instruction schedule, from XLA's buffer assignment and live
    ranges. Values that XLA aliases (a loop's carried state, an update done in place) share one allocation
    slice and are one buffer here, so the live bytes at a position are the device memory in use then."""

    length: int  # positions in the schedule
    buffers: tuple[ScheduledBuffer, ...]
    backward_start: int | None = None  # first position of the gradient pass
    optimizer_start: int | None = None  # first position of the optimizer update

    def live_bytes(self) -> list[int]:
        """Returns the bytes live at each schedule position."""
        delta = [0] * (self.length + 1)
        for b in self.buffers:
            delta[b.start] += b.bytes
            delta[b.end + 1] -= b.bytes
        live, total = [], 0
        for d in delta[:-1]:
            total += d
            live.append(total)
        return live

    @property
    def peak_position(self) -> int:
        live = self.live_bytes()
        return max(range(len(live)), key=live.__getitem__) if live else 0

    @property
    def peak_bytes(self) -> int:
        return max(self.live_bytes(), default=0)

    def live_at(self, position: int) -> list[ScheduledBuffer]:
        """Returns the buffers live at ``position``, largest first."""
        live = [b for b in self.buffers if b.start <= position <= b.end]
        return sorted(live, key=lambda b: (-b.bytes, b.scope))


_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+)(.*):$")
_VALUE = re.compile(r"^ value: <\d+ (?P<name>[\w.\-]+)(?P<index>\{[\d,]*\})?(?: \(phi\))? @\d+> "
                    r"\(size=(?P<size>\d+),offset=(?P<offset>\d+)\): (?P<shape>.*)$")  # fmt: skip
_RANGE = re.compile(r"^    (?P<name>[\w.\-]+)\{(?P<index>[\d,]*)\}:(?P<start>\d+)-(?P<end>\d+)$", re.M)
_SEQUENCE = re.compile(r"^    (\d+):([\w.\-]+)$", re.M)


def _scope_of(table: dict[str, tuple[str, str]], instruction: str) -> str:
    op_name = table.get(instruction, ("", ""))[1]
    if op_name.startswith("stacked "):  # One layer's value stored per scan iteration for the backward pass.
        return readable_scope(op_name.removeprefix("stacked ")) + " (stacked for the backward pass)"
    if op_name.startswith("near "):
        return "from " + readable_scope(op_name.removeprefix("near "))
    return readable_scope(op_name) if op_name else f"{instruction} (made by XLA)"


def _rank(scope: str) -> int:
    """Which of several aliased values names their buffer: an argument, then a model scope, then guesses."""
    if scope.endswith("(argument)"):
        return 0
    if scope.startswith("from ") or scope.endswith("(made by XLA)"):
        return 2
    return 3 if scope == "loop or call carried state" else 1


def buffer_schedule(dump_dir: str | Path) -> BufferSchedule | None:
    """Returns the step's buffers over its schedule from an XLA dump made with ``xla_dump_to`` and
    ``xla_dump_hlo_as_text`` (None when the dump has no buffer assignment)."""
    dump_dir = Path(dump_dir)
    assignments = sorted(dump_dir.glob("*after_optimizations-buffer-assignment.txt"))
    if not assignments:
        return None
    assignment = max(assignments, key=lambda p: p.stat().st_size)
    live_file = Path(str(assignment).replace("-buffer-assignment.txt", "-live-range.txt"))
    hlo_file = Path(str(assignment).replace("-buffer-assignment.txt", ".txt"))
    if not live_file.exists():
        return None
    table = _instructions(hlo_file.read_text()) if hlo_file.exists() else {}

    slices: dict[str, tuple[int, int, int]] = {}  # value -> (allocation, offset, size)
    shapes: dict[str, str] = {}
    allocation, thread_local = -1, False
    for line in assignment.read_text().splitlines():
        header = _ALLOCATION.match(line)
        if header:
            allocation, thread_local = int(header.group(1)), "thread-local" in header.group(3)
            continue
        value = _VALUE.match(line)
        if value and not thread_local:  # Thread-local buffers live in registers, not device memory.
            key = value.group("name") + (value.group("index") or "{}")
            slices[key] = (allocation, int(value.group("offset")), int(value.group("size")))
            shapes[key] = re.sub(r"\{[^}]*\}", "", re.sub(r"/\*.*?\*/", "", value.group("shape"))).strip()

    text = live_file.read_text()
    sequence = _SEQUENCE.findall(text)
    by_slice: dict[tuple[int, int, int], list[tuple[int, int, str, str]]] = {}
    for match in _RANGE.finditer(text):
        key = f"{match.group('name')}{{{match.group('index')}}}"
        if key not in slices:
            continue
        scope = _scope_of(table, match.group("name"))
        by_slice.setdefault(slices[key], []).append(
            (int(match.group("start")), int(match.group("end")), scope, shapes[key])
        )
    buffers = []
    for (_, _, size), values in by_slice.items():
        values.sort()
        group: list = []
        for value in [*values, None]:  # Values whose live ranges overlap share the slice: one buffer.
            if value is not None and (not group or value[0] <= max(v[1] for v in group)):
                group.append(value)
                continue
            if group:
                name = min(group, key=lambda v: _rank(v[2]))
                buffers.append(ScheduledBuffer(size, name[2], name[3], group[0][0], max(v[1] for v in group)))
            group = [value]
    length = max([len(sequence), *(b.end + 1 for b in buffers)])

    phases = []  # (position, phase) of every instruction with a model scope
    for position, instruction in sequence:
        op_name = table.get(instruction, ("", ""))[1]
        if op_name.startswith("jit("):
            phase = 2 if "optimizer_update" in op_name else int("transpose(" in op_name)
            phases.append((int(position), phase))
    return BufferSchedule(
        length=length,
        buffers=tuple(buffers),
        backward_start=_boundary([(p, phase == 1) for p, phase in phases if phase < 2]),
        optimizer_start=_boundary([(p, phase == 2) for p, phase in phases]),
    )


def _boundary(marked: list[tuple[int, bool]]) -> int | None:
    """Returns the position that best splits unmarked instructions (before) from marked ones (after): XLA
    moves a few ops far from their phase (a step counter, a transposed constant), so the first marked one is
    no boundary. None without marked instructions."""
    if not any(m for _, m in marked):
        return None
    best, best_errors, errors = None, None, sum(not m for _, m in marked)  # Split before everything.
    for position, m in marked:
        if best_errors is None or errors < best_errors:
            best, best_errors = position, errors
        errors += 1 if m else -1  # This one now falls before the split.
    return best


def live_at_peak(dump_dir: str | Path, top: int = 10) -> tuple[list[LiveBuffer], int | None]:
    """Returns the largest buffers live at the peak, each counted once however many values XLA aliases
    into it, and the peak of the live bytes, from an XLA dump (see :func:`buffer_schedule`)."""
    schedule = buffer_schedule(dump_dir)
    if schedule is None:
        return [], None
    return peak_buffers(schedule, top), schedule.peak_bytes


def peak_buffers(schedule: BufferSchedule, top: int = 10) -> list[LiveBuffer]:
    """Returns the ``top`` largest buffers live at the schedule's peak."""
    return [LiveBuffer(b.bytes, b.scope, b.shape) for b in schedule.live_at(schedule.peak_position)[:top]]


# --- The optimized module, parsed once -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: its result ``shape`` text (layouts and memory spaces included), ``opcode``,
    operand names and the text of its attributes (``calls=``, ``replica_groups=``, metadata...)."""

    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attributes: str
    arguments: str = ""  # The operand list as written ("0" for parameter(0)).
    inferred_trips: int | None = None  # A loop's trips read from its condition, where XLA states none.

    @property
    def op_name(self) -> str:
        match = _OP_NAME.search(self.attributes)
        return match.group(1) if match else ""

    @property
    def called(self) -> tuple[str, ...]:
        """The computations this instruction calls (a loop's body and condition, a fusion's, ...)."""
        names = []
        for braced, single in _CALLS.findall(self.attributes):
            names += [n.strip() for n in (braced or single).replace("%", "").split(",") if n.strip()]
        return tuple(names)

    @property
    def trip_count(self) -> int | None:
        trips = _TRIPS.search(self.attributes)
        if self.opcode != "while":
            return None
        return int(trips.group(1)) if trips else self.inferred_trips


@dataclasses.dataclass(frozen=True)
class HloModule:
    """An optimized HLO module: its computations, each an instruction list in schedule order (the
    optimized module is scheduled), and an index by instruction name (names are unique in a module)."""

    entry: str
    computations: dict[str, tuple[Instruction, ...]]
    by_name: dict[str, Instruction]

    def executions(self) -> dict[str, int]:
        """How often each computation runs in one run of the module: a loop's body once per known trip,
        everything a called computation calls as often as it runs."""
        callers: dict[str, list[tuple[str, int]]] = {}
        for computation, instructions in self.computations.items():
            for ins in instructions:
                for name in ins.called:
                    callers.setdefault(name, []).append((computation, ins.trip_count or 1))
        counts: dict[str, int] = {}

        def count(name: str, seen: tuple[str, ...] = ()) -> int:
            if name == self.entry:
                return 1
            if name in seen:
                return 0
            if name not in counts:
                counts[name] = sum(n * count(parent, (*seen, name)) for parent, n in callers.get(name, ()))
            return counts[name]

        return {name: count(name) for name in self.computations}

    def kernels(self) -> set[tuple]:
        """The distinct kernels the entry computation's fusions compile to: each fusion's computation with
        its names and metadata left out, as XLA's GPU compiler tells kernels apart when it reuses one it
        has generated (the first of 80 identical layers' is generated, the other 79 reuse it)."""

        def body(name: str) -> tuple:
            instructions = self.computations[name]
            position = {ins.name: str(i) for i, ins in enumerate(instructions)}
            called = {callee: body(callee) for ins in instructions for callee in ins.called}
            return tuple(
                (ins.shape, ins.opcode, ins.arguments if ins.opcode == "parameter" else "",
                 tuple(position.get(o, o) for o in ins.operands),
                 _NAME.sub(lambda m: str(called.get(m[1], "")), _NOT_KERNEL.sub("", ins.attributes)))
                for ins in instructions
            )  # fmt: skip

        fusions = [ins for ins in self.computations.get(self.entry, ()) if ins.opcode == "fusion"]
        return {body(ins.called[0]) for ins in fusions if ins.called}


#: An instruction's attributes from those that do not change its kernel on: the source metadata, the
#: backend configuration (tile sizes a GPU's autotuner would choose), the frontend's attributes.
_NOT_KERNEL = re.compile(r"(metadata|backend_config|frontend_attributes)=\{.*")
_NAME = re.compile(r"%([\w.\-]+)")


def parse_module(hlo_text: str) -> HloModule:
    """Parses the text of an optimized HLO module (``compiled.as_text()``)."""
    computations: dict[str, list[Instruction]] = {}
    by_name: dict[str, Instruction] = {}
    entry = current = ""
    for line in hlo_text.splitlines():
        if not line.startswith(" "):
            header = _COMPUTATION.match(line) if line.rstrip().endswith("{") else None
            if header:
                current = header.group(1)
                entry = current if line.startswith("ENTRY") else entry
                computations[current] = []
            continue
        match = _INSTRUCTION.match(line)
        if not match or not current:
            continue
        shape, remainder = _split_shape(match.group("rest"))
        remainder = remainder.strip()
        opcode, _, rest = remainder.partition("(")
        depth, end = 1, len(rest)
        for i, ch in enumerate(rest):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                end = i
                break
        operands = tuple(re.findall(r"%([\w.\-]+)", re.sub(r"/\*.*?\*/", "", rest[:end])))
        ins = Instruction(match.group("name"), shape, opcode.strip(), operands, rest[end + 1 :], rest[:end])
        computations[current].append(ins)
        by_name[ins.name] = ins
    for instructions in computations.values():  # XLA's TPU compiler writes no known_trip_count.
        for i, ins in enumerate(instructions):
            if ins.opcode == "while" and not _TRIPS.search(ins.attributes):
                trips = _condition_trips(ins, computations, by_name)
                if trips is not None:
                    instructions[i] = by_name[ins.name] = dataclasses.replace(ins, inferred_trips=trips)
    return HloModule(entry, {k: tuple(v) for k, v in computations.items()}, by_name)


def entry_argument_bytes(hlo_text: str) -> tuple[int, int] | None:
    """Returns (bytes of the entry computation's parameters by their shapes, the same laid out in their
    tiles), or None where the module states no tiled layout. XLA's TPU layouts pad arrays to whole
    tiles: ``f32[64]{0:T(128)}`` takes 128 floats, a scalar ``s32[]{:T(128)}`` 512 bytes."""
    entry = re.search(r"entry_computation_layout=\{\((.*?)\)->", hlo_text)
    if not entry or ":T(" not in entry.group(1):
        return None
    logical = padded = 0
    for dtype, dims, layout in re.findall(r"(\w+)\[([\d,]*)\]\{([^}]*)\}", entry.group(1)):
        shape = [int(d) for d in dims.split(",") if d]
        itemsize = _ITEMSIZE.get(dtype, 1)
        logical += itemsize * math.prod(shape)
        order, _, tiling = layout.partition(":")
        tile = re.match(r"T\(([\d,]+)\)", tiling)
        if not tile:
            padded += itemsize * math.prod(shape)
            continue
        tile = [int(t) for t in tile.group(1).split(",")]
        minor_to_major = [int(d) for d in order.split(",") if d]
        tiled = list(shape)
        # The tile covers the most minor dimensions; a tile of more dimensions than the array has
        # pads the missing (outer) ones to the tile too.
        sizes = tile[-len(minor_to_major) :] if shape else []
        for dim, size in zip(reversed(minor_to_major[: len(tile)]), sizes, strict=False):
            tiled[dim] = -(-tiled[dim] // size) * size
        outer = math.prod(tile[: max(len(tile) - len(shape), 0)])
        padded += itemsize * math.prod(tiled) * outer
    return logical, padded


def _condition_trips(loop: Instruction, computations, by_name) -> int | None:
    """The trips of a counted loop (a scan) whose condition is ``counter < N`` on a constant N and whose
    counter starts at a constant (JAX's scans and fori_loops), or None."""
    condition = re.search(r"condition=%?([\w.\-]+)", loop.attributes)
    body = computations.get(condition.group(1), ()) if condition else ()
    counter, limit = _compared(body, computations, by_name)
    if not (counter and limit and limit.opcode == "constant" and counter.opcode == "get-tuple-element"):
        return None
    index = re.search(r"index=(\d+)", counter.attributes)
    start = by_name.get(loop.operands[0]) if loop.operands else None
    if not index or start is None or start.opcode != "tuple" or int(index.group(1)) >= len(start.operands):
        return None
    initial = by_name.get(start.operands[int(index.group(1))])
    while initial is not None and initial.opcode in ("copy", "bitcast") and initial.operands:
        initial = by_name.get(initial.operands[0])
    if initial is None or initial.opcode != "constant":
        return None
    step = re.search(r'"known_init_step":\{"init":"-?\d+","step":"(\d+)"', loop.attributes)
    try:
        return max(
            -(-(int(limit.arguments) - int(initial.arguments)) // int(step.group(1) if step else 1)), 0
        )
    except (ValueError, ZeroDivisionError):
        return None


def _compared(condition, computations, by_name) -> tuple[Instruction | None, Instruction | None]:
    """The (counter, limit) of a loop condition's one ``counter < limit``, written in the condition or,
    as XLA's GPU compiler writes it once collectives are pipelined, in the one fusion it calls."""
    compares = [i for i in condition if i.opcode == "compare" and "direction=LT" in i.attributes]
    if len(compares) == 1 and len(compares[0].operands) == 2:
        counter, limit = (by_name.get(name) for name in compares[0].operands)
        return counter, limit
    fusions = [i for i in condition if i.opcode == "fusion" and len(i.called) == 1]
    if compares or len(fusions) != 1:
        return None, None
    fused = computations.get(fusions[0].called[0], ())
    inner = [i for i in fused if i.opcode == "compare" and "direction=LT" in i.attributes]
    if len(inner) != 1 or len(inner[0].operands) != 2:
        return None, None
    parameter, limit = (by_name.get(name) for name in inner[0].operands)
    if parameter is None or parameter.opcode != "parameter" or not parameter.arguments.strip().isdigit():
        return None, None
    index = int(parameter.arguments)
    operands = fusions[0].operands
    return (by_name.get(operands[index]) if index < len(operands) else None), limit


# --- Collective traffic ----------------------------------------------------------------------------

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_ARRAY = re.compile(r"\b(pred|[subf]\d+|bf16|f8\w*)\[([\d,]*)\]")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
             "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}  # fmt: skip
# One computation (calls=%f) or a braced list (branch_computations={%a, %b}).
_CALLS = re.compile(r"(?:body|condition|to_apply|calls|branch_computations)=(?:\{([^}]*)\}|%?([\w.\-]+))")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


def shape_bytes(shape: str) -> int:
    """Bytes of every array in a shape text ("(f32[2,3]{1,0}, bf16[4])" -> 32)."""
    return sum(
        _ITEMSIZE.get(dtype, 1) * math.prod(int(d) for d in dims.split(",") if d)
        for dtype, dims in _ARRAY.findall(shape)
    )


_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
_MEGASCALE_KINDS = {"ALL_REDUCE": "all-reduce", "ALL_GATHER": "all-gather",
                    "REDUCE_SCATTER": "reduce-scatter", "ALL_TO_ALL": "all-to-all"}  # fmt: skip


def collective_kind(ins: Instruction) -> str | None:
    """The collective an instruction starts or runs ("all-gather" for ``all-gather-start``), or None.
    Between TPU slices libtpu lowers a collective to a MegaScale ``send`` (and a ``recv``) over DCN,
    named by its ``_xla_megascale_transfer_type``; the send stands for the collective."""
    if ins.opcode == "send":
        megascale = _MEGASCALE.search(ins.attributes)
        return _MEGASCALE_KINDS.get(megascale.group(1), "collective-permute") if megascale else None
    if ins.opcode.endswith("-done"):
        return None
    base = ins.opcode.removesuffix("-start")
    return base if base in COLLECTIVES else None


def is_megascale(ins: Instruction) -> bool:
    """Whether ``ins`` is a collective between TPU slices (a MegaScale send over DCN)."""
    return ins.opcode == "send" and collective_kind(ins) is not None


def collective_result_bytes(ins: Instruction) -> int:
    """Bytes a collective produces per device: an async start's shape is (operands, results). A
    MegaScale send's shape is (data, context, token): the bytes it sends."""
    shape = ins.shape
    if ins.opcode == "send" and shape.startswith("("):
        shape = _tuple_element(shape, "0")
    elif ins.opcode.endswith("-start") and shape.startswith("("):
        shape = _tuple_element(shape, "-1")
    return shape_bytes(shape)


_ONE_OF = re.compile(rf"(?:^|/){ONE_OF_SCOPE}_\d+/(\d+)(?:/|$)")


def one_of_groups(instructions: Sequence[Instruction]) -> dict[str, tuple[Instruction, ...]]:
    """Returns, for a computation's instructions, the loops of which a device runs one (a 1F1B tick's
    op: :data:`~shardmem.parallel.schedule.ONE_OF_SCOPE`), by the name of each group's first loop."""
    loops = [(ins, ins.op_name) for ins in instructions if ins.opcode == "while"]
    return {group[0].name: group for group in _one_of_runs(loops)}


def one_of_index(loop: Instruction) -> int:
    """Which of its group's alternatives a loop of :func:`one_of_groups` is (a 1F1B tick's op code)."""
    return int(_ONE_OF.search(loop.op_name).group(1))


def _eqn_one_of_index(eqn) -> int:  # The same, of a jaxpr's loop.
    return int(_ONE_OF.search(str(eqn.source_info.name_stack)).group(1))


def _one_of_runs(items: Sequence[tuple[object, str]]) -> list[tuple]:
    """Groups ``(item, scope)`` pairs, in program order, whose scope names one of alternatives: a group
    is one run of them by increasing index, so a lower or equal index starts the next group (a loop of
    ticks XLA unrolled twice runs two groups)."""
    groups: list[list] = []
    last = -1
    for item, scope in items:
        match = _ONE_OF.search(scope)
        if not match:
            continue
        index = int(match.group(1))
        if index <= last or not groups:
            groups.append([])
        groups[-1].append(item)
        last = index
    return [tuple(group) for group in groups]


def collective_bytes(hlo_text: str | HloModule) -> dict[str, int]:
    """Returns the bytes per device that each kind of collective produces in one run of an optimized
    HLO module (result shapes), with ops inside while loops counted once per known trip and, of a
    conditional's branches or a group of loops of which a device runs one (:func:`one_of_groups`), the
    one that moves the most (a 1F1B tick runs its stage's op; the step-time replay charges the slowest,
    and its collectives)."""
    module = hlo_text if isinstance(hlo_text, HloModule) else parse_module(hlo_text)
    memo: dict[str, dict[str, int]] = {}

    def moved(name: str, seen: tuple[str, ...] = ()) -> dict[str, int]:
        if name in memo:
            return memo[name]
        totals = dict.fromkeys(COLLECTIVES, 0)
        if name in seen:
            return totals
        instructions = module.computations.get(name, ())
        groups = one_of_groups(instructions)
        grouped = {loop.name for loops in groups.values() for loop in loops}
        for ins in instructions:
            kind = collective_kind(ins)
            if kind:
                totals[kind] += collective_result_bytes(ins)
            if ins.name in grouped and ins.name not in groups:
                continue  # Counted with its group's first loop.
            inner = [moved(called, (*seen, name)) for called in ins.called]
            if ins.name in groups:
                inner = [_summed([moved(called, (*seen, name)) for called in loop.called])
                         for loop in groups[ins.name]]  # fmt: skip
            if (ins.opcode == "conditional" or ins.name in groups) and inner:
                inner = [max(inner, key=lambda branch: sum(branch.values()))]
            for branch in inner:
                for key, value in branch.items():
                    totals[key] += value * (ins.trip_count or 1)
        memo[name] = totals
        return totals

    return moved(module.entry)


def _summed(tallies: Sequence[dict[str, int]]) -> dict[str, int]:
    return {key: sum(tally[key] for tally in tallies) for key in COLLECTIVES}
