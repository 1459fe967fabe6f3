# The interface of the nanobind extension built from engine/native/row_product.cpp (make ext).

import mlx.core as mx

MAX_ROWS: int

def row_product(x: mx.array, w: mx.array, *, stream: mx.Stream | mx.Device | None = None) -> mx.array: ...
def threads() -> int: ...
def slot_attention(q: mx.array, k: mx.array, v: mx.array, offset: mx.array, scale: float, *,
                   stream: mx.Stream | mx.Device | None = None) -> mx.array: ...
