"""How prefix-cache state maps onto the block store's byte-level layouts.

* **Block layers** (``KVCache`` / ``QuantizedKVCache``): one segment per array, rows are
  tokens (``[B, H, T, X]`` -> outer ``B*H``, row ``X`` elements), named
  ``"<layer>.<tag>.<array>"``; in a model that also has non-trimmable layers the names end
  in ``.part``, so those blocks are only ever restored together with a checkpoint.
* **Checkpoints** (every other layer: rotating windows, SSM / linear-attention state): each
  array of the layers' ``state`` is one whole segment (``outer=1``, one row), plus a first
  segment ``ckpt.skel`` (or ``ckpt.skel.blocks`` when the block layers are stored as
  blocks beside it) whose bytes are a small JSON skeleton: per layer its index, class and
  state tree with ints, ``None`` and array references. The skeleton is payload, so it is
  covered by the content hash like the arrays.

Nothing here does I/O; ``engine.cache.prefix_cache`` submits and restores.
"""

from __future__ import annotations

import json
import re
from typing import Any

import mlx.core as mx
import numpy as np

from engine.cache import kvblocks as kb

_DTYPES = {str(getattr(mx, n)): n for n in (
    "float32", "float16", "bfloat16", "uint32", "int32", "uint8", "int8", "uint16", "int16",
    "int64", "uint64")}
SKEL = "ckpt.skel"
SKEL_WITH_BLOCKS = "ckpt.skel.blocks"
# classes a skeleton may name (never an arbitrary attribute of the module)
_CLASSES = {c.__name__: c for c in kb.CHECKPOINT_TYPES}


def dtype_name(a: mx.array) -> str:
    name = _DTYPES.get(str(a.dtype))
    if name is None:
        raise kb.UnsupportedCache(f"dtype {a.dtype} cannot be persisted")
    return name


def _contiguous(a: mx.array) -> mx.array:
    a = kb.fresh(a)
    mx.eval(a)
    if not memoryview(a).c_contiguous:
        a = mx.contiguous(a)
        mx.eval(a)
    return a


def split_layers(cache: list) -> tuple[list[int], list[int]]:
    """(indices of block layers, indices of checkpoint-only layers)."""
    blocks = [i for i, c in enumerate(cache) if type(c) in kb.BLOCK_TYPES]
    return blocks, [i for i in range(len(cache)) if i not in set(blocks)]


# ----------------------------------------------------------------------------- blocks
def block_layout(cache: list, ntokens: int, indices: list[int] | None = None,
                 part: bool = False) -> tuple[list, list, list]:
    """(layout specs, segments, arrays to pin) of rows [0, ntokens) of the block layers
    ``indices`` (all layers when None)."""
    from storage.format import SegmentSpec

    specs, segs, keep = [], [], []
    for li in range(len(cache)) if indices is None else indices:
        c = cache[li]
        spec = kb.layer_spec(c)
        tag = "kv" if spec.kind == "kv" else f"q{spec.bits}g{spec.group_size}"
        names = ("k", "v") if spec.kind == "kv" else ("kq", "ks", "kb", "vq", "vs", "vb")
        for name, a in zip(names, kb.layer_arrays(c)):
            if a.ndim != 4 or a.shape[2] < ntokens:
                raise ValueError(f"layer {li}: unexpected KV array shape {a.shape}")
            a = _contiguous(a)
            outer = a.shape[0] * a.shape[1]
            row = a.shape[3] * a.itemsize
            specs.append(SegmentSpec(f"{li}.{tag}.{name}" + (".part" if part else ""),
                                     dtype_name(a), (a.shape[3],), outer, row))
            segs.append((kb.byte_view(a), outer, a.shape[2], row))
            keep.append(a)
    return specs, segs, keep


def is_partial(layout: Any) -> bool:
    """Whether stored blocks hold only some layers (restore them with a checkpoint only)."""
    return bool(layout) and layout[0].name.endswith(".part")


def parse_block_layout(layout: Any) -> list[tuple[int, kb.LayerSpec, list]]:
    """Group a stored block layout back into layers: [(index, LayerSpec, [SegmentSpec])]."""
    layers: list[tuple[int, kb.LayerSpec, list]] = []
    for s in layout:
        parts = s.name.split(".")
        if len(parts) not in (3, 4) or not parts[0].isdigit():
            raise ValueError(f"unknown segment name {s.name!r} in a stored layout")
        li, tag = int(parts[0]), parts[1]
        if not layers or layers[-1][0] != li:
            if tag == "kv":
                spec = kb.LayerSpec("kv")
            else:
                m = re.fullmatch(r"q(\d+)g(\d+)", tag)
                if m is None:
                    raise ValueError(f"unknown layer tag {tag!r} in a stored layout")
                spec = kb.LayerSpec("qkv", int(m.group(2)), int(m.group(1)))
            layers.append((li, spec, []))
        layers[-1][2].append(s)
    return layers


# ----------------------------------------------------------------------------- checkpoints
def _skeleton(obj: Any, arrays: list) -> Any:
    if isinstance(obj, mx.array):
        arrays.append(obj)
        return {"a": len(arrays) - 1}
    if obj is None or (isinstance(obj, int) and not isinstance(obj, bool)):
        return obj
    if isinstance(obj, tuple):
        return {"t": [_skeleton(o, arrays) for o in obj]}
    if isinstance(obj, list):
        return [_skeleton(o, arrays) for o in obj]
    raise kb.UnsupportedCache(f"cannot persist a {type(obj).__name__} in a cache state")


def _rebuild(obj: Any, arrays: list) -> Any:
    if isinstance(obj, dict):
        if "a" in obj:
            return arrays[obj["a"]]
        return tuple(_rebuild(o, arrays) for o in obj["t"])
    if isinstance(obj, list):
        return [_rebuild(o, arrays) for o in obj]
    return obj


def checkpoint_layout(cp: kb.Checkpoint, indices: list[int], with_blocks: bool
                      ) -> tuple[list, list, list]:
    """(layout specs, segments, arrays to pin) of the checkpoint layers ``indices`` of
    ``cp`` (a whole-cache checkpoint): the skeleton, then each state array whole."""
    from storage.format import SegmentSpec

    arrays: list[mx.array] = []
    layers = [[li, cp.layers[li][0].__name__, _skeleton(cp.layers[li][1], arrays)]
              for li in indices]
    skel = json.dumps({"v": 1, "layers": layers}, separators=(",", ":")).encode()
    skel_a = mx.array(np.frombuffer(skel, dtype=np.uint8))
    mx.eval(skel_a)
    specs = [SegmentSpec(SKEL_WITH_BLOCKS if with_blocks else SKEL, "uint8", (len(skel),),
                         1, len(skel))]
    keep = [skel_a]
    for j, a in enumerate(arrays):
        if a.size == 0:
            raise kb.UnsupportedCache("an empty array in a cache state cannot be persisted")
        a = _contiguous(a)
        specs.append(SegmentSpec(f"ckpt.{j}", dtype_name(a), tuple(int(s) for s in a.shape),
                                 1, a.nbytes))
        keep.append(a)
    segs = [(kb.byte_view(a), 1, 1, a.nbytes) for a in keep]
    return specs, segs, keep


def checkpoint_has_blocks(layout: Any) -> bool:
    if not layout or layout[0].name not in (SKEL, SKEL_WITH_BLOCKS):
        raise ValueError("not a checkpoint layout (no skeleton segment first)")
    return layout[0].name == SKEL_WITH_BLOCKS


def checkpoint_buffers(layout: Any) -> list[mx.array]:
    """Writable destination arrays for a stored checkpoint layout (skeleton first)."""
    checkpoint_has_blocks(layout)
    shapes, dtypes = [], []
    for i, s in enumerate(layout):
        shapes.append(tuple(s.shape))
        dtypes.append(getattr(mx, s.dtype))
        if i and (getattr(mx, s.dtype).size * int(np.prod(s.shape)) != s.row_bytes
                  or s.outer != 1):
            raise ValueError(f"segment {s.name} is not a whole state")
    return kb.writable_arrays(shapes, dtypes)


def checkpoint_layers(layout: Any, arrays: list[mx.array]) -> dict[int, Any]:
    """{layer index: mlx-lm layer cache} from restored checkpoint arrays."""
    skel = json.loads(bytes(kb.byte_view(arrays[0])))
    if not isinstance(skel, dict) or skel.get("v") != 1:
        raise ValueError("unknown checkpoint skeleton version")
    out: dict[int, Any] = {}
    for li, cls_name, tree in skel["layers"]:
        cls = _CLASSES.get(cls_name)
        if cls is None:
            raise ValueError(f"checkpoint names an unknown cache class {cls_name!r}")
        out[int(li)] = cls.from_state(_rebuild(tree, arrays[1:]))
    return out
