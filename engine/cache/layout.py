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

Versioning: :func:`kv_namespace` folds :data:`KV_LAYOUT_VERSION` (this mapping) and a
fingerprint of the mlx-lm cache classes' positional ``state`` schema (which the skeleton
and ``from_state`` rely on) into the namespace, so state written under another mapping or
another mlx-lm schema is never read back as this one. Dtype names read from a stored
header are looked up in a whitelist (:func:`mx_dtype`), never as attributes of ``mx``.

Nothing here does I/O; ``engine.cache.ssd`` submits and restores.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias

import mlx.core as mx
import numpy as np
import xxhash

from mlxkv.engine.cache import kvblocks
from mlxkv.engine.cache.buffers import memory_of

if TYPE_CHECKING:
    from mlx_lm.models.cache import _BaseCache

    from mlxkv.storage.format import Layout, SegmentSpec
    from mlxkv.storage.keys import Segment

# A block layer to restore into: (layer index, its LayerSpec, its arrays).
RestoreLayer: TypeAlias = "tuple[int, kvblocks.LayerSpec, list[mx.array]]"
# What a restore may take ready arrays from: (stored segments, rows) -> arrays or None.
Taker: TypeAlias = "Callable[[list[SegmentSpec], int], list[mx.array] | None]"
# A checkpoint skeleton: JSON (ints, None, {"a": i} array references, {"t": [...]} tuples).
Skeleton: TypeAlias = Any

# Bump when the mapping of cache state onto segments and skeletons changes.
KV_LAYOUT_VERSION = 2
# the only dtypes a stored layout may name (a header string is never an attribute lookup)
DTYPES: dict[str, mx.Dtype] = {
    "float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16,
    "uint32": mx.uint32, "int32": mx.int32, "uint8": mx.uint8, "int8": mx.int8,
    "uint16": mx.uint16, "int16": mx.int16, "int64": mx.int64, "uint64": mx.uint64,
    "bool": mx.bool_}
_DTYPES = {str(d): n for n, d in DTYPES.items()}
SKEL = "ckpt.skel"
SKEL_WITH_BLOCKS = "ckpt.skel.blocks"
# classes a skeleton may name (never an arbitrary attribute of the module)
_CLASSES: dict[str, type[kvblocks.LayerCache]] = {c.__name__: c for c in kvblocks.CHECKPOINT_TYPES}


class LayoutError(ValueError):
    """A stored layout this code cannot or must not restore (a miss, with the reason)."""


def mx_dtype(name: str) -> mx.Dtype:
    """The mx dtype a stored layout names; LayoutError for anything not whitelisted."""
    d = DTYPES.get(name) if isinstance(name, str) else None
    if d is None:
        raise LayoutError(f"a stored layout names the dtype {name!r}, which is not one of "
                          f"{', '.join(sorted(DTYPES))}")
    return d


def _state_fields(cls: type[_BaseCache]) -> tuple[str, ...]:
    """The instance attributes ``cls().state`` returns, in order (probed with sentinels,
    no source needed), or a marker when the probe fails."""
    try:
        obj = cls.__new__(cls)
        names = ("keys", "values", "offset", "group_size", "bits", "keep", "max_size", "_idx",
                 "step", "cache", "left_padding", "lengths")
        for n in names:
            try:
                object.__setattr__(obj, n, f"<{n}>")
            except AttributeError:
                continue
        state = obj.state
        return tuple(str(x) if isinstance(x, str) else type(x).__name__ for x in state)
    except Exception as exc:  # noqa: BLE001  (a schema we cannot probe is its own schema)
        return (f"unprobed:{type(exc).__name__}",)


def state_schema(classes: tuple[type[_BaseCache], ...] | None = None) -> str:
    """Fingerprint of the positional ``state`` schema of the cache classes restored here
    (class names and field order) and of mlx-lm's major.minor version."""
    import mlx_lm

    classes = kvblocks.CHECKPOINT_TYPES if classes is None else classes
    major_minor = ".".join(str(getattr(mlx_lm, "__version__", "0.0")).split(".")[:2])
    desc = ";".join(f"{c.__name__}({','.join(_state_fields(c))})" for c in classes)
    return xxhash.xxh3_64_hexdigest(f"mlx-lm {major_minor};{desc}".encode())


def kv_namespace(model_fingerprint: str, compute_dtype: str) -> str:
    """The prefix-cache namespace of a model's KV state: the model fingerprint, the
    compute dtype, :data:`KV_LAYOUT_VERSION` and :func:`state_schema` (a valid store
    folder name)."""
    if not re.fullmatch(r"[A-Za-z0-9]{1,64}", str(model_fingerprint)):
        raise ValueError(f"model fingerprint must be 1-64 letters or digits, got "
                         f"{model_fingerprint!r}")
    if not re.fullmatch(r"[A-Za-z0-9]{1,16}", str(compute_dtype)):  # e.g. "float32", "none"
        raise ValueError(f"compute dtype must be 1-16 letters or digits, got {compute_dtype!r}")
    return f"{model_fingerprint}-{compute_dtype}-kv{KV_LAYOUT_VERSION}-{state_schema()[:12]}"


def dtype_name(a: mx.array) -> str:
    name = _DTYPES.get(str(a.dtype))
    if name is None:
        raise kvblocks.UnsupportedCache(f"dtype {a.dtype} cannot be persisted")
    return name


def _contiguous(a: mx.array) -> mx.array:
    a = kvblocks.fresh(a)
    mx.eval(a)
    if not memory_of(a).c_contiguous:
        a = mx.contiguous(a)
        mx.eval(a)
    return a


def split_layers(cache: kvblocks.PromptCache) -> tuple[list[int], list[int]]:
    """(indices of block layers, indices of checkpoint-only layers)."""
    blocks = [i for i, c in enumerate(cache) if type(c) in kvblocks.BLOCK_TYPES]
    return blocks, [i for i in range(len(cache)) if i not in set(blocks)]


# ----------------------------------------------------------------------------- blocks
def block_layout(cache: kvblocks.PromptCache, ntokens: int, indices: list[int] | None = None,
                 part: bool = False
                 ) -> tuple[list[SegmentSpec], list[Segment], list[mx.array]]:
    """(layout specs, segments, arrays to pin) of rows [0, ntokens) of the block layers
    ``indices`` (all layers when None)."""
    from mlxkv.storage.format import SegmentSpec

    specs: list[SegmentSpec] = []
    segs: list[Segment] = []
    keep: list[mx.array] = []
    for li in range(len(cache)) if indices is None else indices:
        c = cache[li]
        spec = kvblocks.layer_spec(c)
        tag = "kv" if spec.kind == "kv" else f"q{spec.bits}g{spec.group_size}"
        names = ("k", "v") if spec.kind == "kv" else ("kq", "ks", "kb", "vq", "vs", "vb")
        for name, a in zip(names, kvblocks.layer_arrays(c)):
            if a.ndim != 4 or a.shape[2] < ntokens:
                raise ValueError(f"layer {li}: unexpected KV array shape {a.shape}")
            a = _contiguous(a)
            outer = a.shape[0] * a.shape[1]
            row = a.shape[3] * a.itemsize
            specs.append(SegmentSpec(f"{li}.{tag}.{name}" + (".part" if part else ""),
                                     dtype_name(a), (a.shape[3],), outer, row))
            segs.append((kvblocks.byte_view(a), outer, a.shape[2], row))
            keep.append(a)
    return specs, segs, keep


def is_partial(layout: Layout | None) -> bool:
    """Whether stored blocks hold only some layers (restore them with a checkpoint only)."""
    return bool(layout and layout[0].name.endswith(".part"))


_ARRAY_NAMES = {"kv": ("k", "v"), "qkv": ("kq", "ks", "kb", "vq", "vs", "vb")}


def parse_block_layout(layout: Layout | None
                       ) -> list[tuple[int, kvblocks.LayerSpec, list[SegmentSpec]]]:
    """Group a stored block layout back into layers: [(index, LayerSpec, [SegmentSpec])].
    LayoutError unless every layer has exactly its arrays, in order, of whitelisted dtypes
    with the shapes block rows have (one trailing dimension)."""
    if not layout:
        raise LayoutError("an empty stored layout")
    part = is_partial(layout)
    layers: list[tuple[int, kvblocks.LayerSpec, list[SegmentSpec]]] = []
    for s in layout:
        parts = s.name.split(".")
        if len(parts) != (4 if part else 3) or not parts[0].isdigit() or \
                (part and parts[3] != "part"):
            raise LayoutError(f"unknown segment name {s.name!r} in a stored layout")
        li, tag = int(parts[0]), parts[1]
        if not layers or layers[-1][0] != li:
            if layers and li <= layers[-1][0]:
                raise LayoutError(f"layer {li} is out of order in a stored layout")
            if tag == "kv":
                spec = kvblocks.LayerSpec("kv")
            else:
                m = re.fullmatch(r"q(\d+)g(\d+)", tag)
                if m is None:
                    raise LayoutError(f"unknown layer tag {tag!r} in a stored layout")
                spec = kvblocks.LayerSpec("qkv", int(m.group(2)), int(m.group(1)))
            layers.append((li, spec, []))
        mx_dtype(s.dtype)
        if len(s.shape) != 1 or s.shape[0] * DTYPES[s.dtype].size != s.row_bytes:
            raise LayoutError(f"segment {s.name}: shape {s.shape} of {s.dtype} is not "
                              f"{s.row_bytes} bytes per row")
        layers[-1][2].append(s)
    for li, spec, segs in layers:
        want = _ARRAY_NAMES[spec.kind]
        if tuple(s.name.split(".")[2] for s in segs) != want:
            raise LayoutError(f"layer {li} stores {[s.name for s in segs]}, not {list(want)}")
    if not part and [li for li, _, _ in layers] != list(range(len(layers))):
        raise LayoutError("a stored layout does not hold a whole model's layers")
    return layers


def block_buffers(layout: Layout | None, cap: int, take: Taker | None = None,
                  populate: bool = True
                  ) -> tuple[list[RestoreLayer], list[Segment], list[mx.array]]:
    """(per layer (index, LayerSpec, arrays), segments, all arrays) to restore blocks of
    the stored ``layout`` into, with room for ``cap`` tokens. ``take(flat_specs, cap)``
    may supply ready arrays (the KV arena: same segments, room for at least ``cap``);
    otherwise they are allocated. LayoutError when the layout is not one this code
    writes. ``populate=False``: allocated arrays are not pre-faulted (their first writer
    takes the faults)."""
    by_layer = parse_block_layout(layout)
    flat = [s for _, _, seg_specs in by_layer for s in seg_specs]
    arrays = None if take is None else take(flat, cap)
    if arrays is None:
        arrays = kvblocks.writable_arrays([(1, s.outer, cap, *s.shape) for s in flat],
                                          [DTYPES[s.dtype] for s in flat], populate=populate)
    segs: list[Segment] = [(kvblocks.byte_view(a), s.outer, int(a.shape[2]), s.row_bytes)
                           for a, s in zip(arrays, flat)]
    layers: list[RestoreLayer] = []
    i = 0
    for li, spec, seg_specs in by_layer:
        layers.append((li, spec, arrays[i : i + len(seg_specs)]))
        i += len(seg_specs)
    return layers, segs, arrays


# ----------------------------------------------------------------------------- checkpoints
def _skeleton(obj: kvblocks.LayerState, arrays: list[mx.array]) -> Skeleton:
    if isinstance(obj, mx.array):
        arrays.append(obj)
        return {"a": len(arrays) - 1}
    if obj is None or (isinstance(obj, int) and not isinstance(obj, bool)):
        return obj
    if isinstance(obj, tuple):
        return {"t": [_skeleton(o, arrays) for o in obj]}
    if isinstance(obj, list):
        return [_skeleton(o, arrays) for o in obj]
    raise kvblocks.UnsupportedCache(f"cannot persist a {type(obj).__name__} in a cache state")


def _rebuild(obj: Skeleton, arrays: list[mx.array]) -> kvblocks.LayerState:
    if isinstance(obj, dict):
        if "a" in obj:
            return arrays[obj["a"]]
        return tuple(_rebuild(o, arrays) for o in obj["t"])
    if isinstance(obj, list):
        return [_rebuild(o, arrays) for o in obj]
    return obj


def checkpoint_layout(checkpoint: kvblocks.Checkpoint, indices: list[int], with_blocks: bool
                      ) -> tuple[list[SegmentSpec], list[Segment], list[mx.array]]:
    """(layout specs, segments, arrays to pin) of the checkpoint layers ``indices`` of
    ``checkpoint`` (a whole-cache checkpoint): the skeleton, then each state array whole."""
    from mlxkv.storage.format import SegmentSpec

    arrays: list[mx.array] = []
    layers = [[li, checkpoint.layers[li][0].__name__, _skeleton(checkpoint.layers[li][1], arrays)]
              for li in indices]
    skel = json.dumps({"v": 1, "layers": layers}, separators=(",", ":")).encode()
    skel_a = mx.array(np.frombuffer(skel, dtype=np.uint8))
    mx.eval(skel_a)
    specs = [SegmentSpec(SKEL_WITH_BLOCKS if with_blocks else SKEL, "uint8", (len(skel),),
                         1, len(skel))]
    keep = [skel_a]
    for j, a in enumerate(arrays):
        if a.size == 0:
            raise kvblocks.UnsupportedCache("an empty array in a cache state cannot be persisted")
        a = _contiguous(a)
        specs.append(SegmentSpec(f"ckpt.{j}", dtype_name(a), tuple(int(s) for s in a.shape),
                                 1, a.nbytes))
        keep.append(a)
    segs: list[Segment] = [(kvblocks.byte_view(a), 1, 1, a.nbytes) for a in keep]
    return specs, segs, keep


def checkpoint_has_blocks(layout: Layout | None) -> bool:
    if not layout or layout[0].name not in (SKEL, SKEL_WITH_BLOCKS):
        raise LayoutError("not a checkpoint layout (no skeleton segment first)")
    return layout[0].name == SKEL_WITH_BLOCKS


def checkpoint_buffers(layout: Layout | None) -> list[mx.array]:
    """Writable destination arrays for a stored checkpoint layout (skeleton first)."""
    checkpoint_has_blocks(layout)  # LayoutError unless a (non-empty) checkpoint layout
    shapes: list[tuple[int, ...]] = []
    dtypes: list[mx.Dtype] = []
    for i, s in enumerate(layout or ()):
        shapes.append(tuple(s.shape))
        dtypes.append(mx_dtype(s.dtype))
        if i and (dtypes[-1].size * int(np.prod(s.shape)) != s.row_bytes or s.outer != 1):
            raise LayoutError(f"segment {s.name} is not a whole state")
    return kvblocks.writable_arrays(shapes, dtypes)


def checkpoint_layers(layout: Layout | None, arrays: list[mx.array]
                      ) -> dict[int, kvblocks.LayerCache]:
    """{layer index: mlx-lm layer cache} from restored checkpoint arrays; LayoutError
    when the skeleton does not describe states of the whitelisted classes."""
    try:
        skel = json.loads(bytes(kvblocks.byte_view(arrays[0])))
        if not isinstance(skel, dict) or skel.get("v") != 1:
            raise LayoutError("unknown checkpoint skeleton version")
        out: dict[int, kvblocks.LayerCache] = {}
        for li, cls_name, tree in skel["layers"]:
            cls = _CLASSES.get(cls_name)
            if cls is None:
                raise LayoutError(f"checkpoint names an unknown cache class {cls_name!r}")
            out[int(li)] = cls.from_state(_rebuild(tree, arrays[1:]))
    except LayoutError:
        raise
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise LayoutError(f"unusable checkpoint skeleton: {exc}") from exc
    return out
