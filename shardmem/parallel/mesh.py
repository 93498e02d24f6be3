"""The device mesh: named axes over local, simulated or compile-only devices.

    mesh = build_mesh({"data": 1, "fsdp": -1, "tensor": 8}, devices)

Devices are ordered host by host, so the last mesh axes vary within a host (fast interconnect) and the
first ones across hosts (the data-centre network): put ``tensor`` last and ``data`` first. TPU chips are
laid out on their slice's torus by ``jax.experimental.mesh_utils`` (each axis on neighbouring chips), and
across slices (multislice) by the first axes.

Every axis is ``AxisType.Auto`` (the compiler propagates shardings from the rules' constraints), pinned
rather than left to JAX's default: ``jax.make_mesh`` makes Explicit axes (sharding in types), under which
the same config would build another program, or none. :func:`auto_axes` converts a mesh made elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from jax.sharding import AxisType, Mesh

from shardmem.errors import ConfigError


def resolve_axes(axes: Mapping[str, int], n_devices: int) -> dict[str, int]:
    """Returns the axis sizes with a ``-1`` replaced by the devices the others leave."""
    fixed = math.prod(size for size in axes.values() if size != -1)
    shown = ", ".join(f"{k}: {v}" for k, v in axes.items())
    if -1 in axes.values():
        free = next(k for k, v in axes.items() if v == -1)
        if n_devices % fixed:
            raise ConfigError(
                f"mesh.axes {{{shown}}}: the fixed axes multiply to {fixed}, which does not divide "
                f"the {n_devices} devices, so mesh.axes.{free}=-1 has no size; make the fixed axes "
                f"divide {n_devices}"
            )
        return {k: (n_devices // fixed if v == -1 else v) for k, v in axes.items()}
    if fixed != n_devices:
        raise ConfigError(
            f"mesh.axes {{{shown}}} multiply to {fixed}, but there are {n_devices} devices; make "
            f"them multiply to {n_devices}, or set one axis to -1 to take the remaining devices"
        )
    return dict(axes)


def build_mesh(axes: Mapping[str, int], devices: Sequence) -> Mesh:
    """Returns a Mesh with the given named axes over ``devices`` (a -1 axis takes the rest)."""
    sizes = resolve_axes(axes, len(devices))
    if devices and devices[0].platform == "tpu":
        grid = _tpu_grid(tuple(sizes.values()), devices)
        return Mesh(grid, tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes))
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    grid = np.array(ordered, dtype=object).reshape(tuple(sizes.values()))
    return Mesh(grid, tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes))


def auto_axes(mesh: Mesh) -> Mesh:
    """Returns ``mesh`` with every axis ``AxisType.Auto`` (itself when they already are): the axis type
    :func:`build_mesh` gives and shardmem's rules are written for, e.g. for a ``jax.make_mesh`` mesh."""
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def _tpu_grid(shape: tuple[int, ...], devices: Sequence) -> np.ndarray:
    """The chips in ``shape``, physically laid out: XLA's collectives on a TPU torus are fastest between
    neighbours. Several slices: the outer axes go across them (DCN), the rest inside each slice."""
    from jax.experimental import mesh_utils

    slices = len({getattr(d, "slice_index", 0) for d in devices})
    try:
        if slices == 1:
            return mesh_utils.create_device_mesh(shape, devices=devices, allow_split_physical_axes=True)
        dcn, left = [], slices  # Axes from the outside take the slices until they are used up.
        for size in shape:
            step = math.gcd(size, left)
            dcn.append(step)
            left //= step
        if left == 1:
            ici = tuple(size // d for size, d in zip(shape, dcn, strict=True))
            return mesh_utils.create_hybrid_device_mesh(ici, tuple(dcn), devices=devices,
                                                        allow_split_physical_axes=True)  # fmt: skip
    except (ValueError, NotImplementedError, AssertionError):
        pass  # A shape mesh_utils cannot fold onto the torus: fall back to the devices' order.
    ordered = sorted(devices, key=lambda d: (getattr(d, "slice_index", 0), d.process_index, d.id))
    return np.array(ordered, dtype=object).reshape(shape)
