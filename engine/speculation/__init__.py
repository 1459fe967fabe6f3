"""Speculative decoding: sources of proposed tokens behind one seam (``engine.speculation.base``)
and the verifier that decides every token."""

from mlxkv.engine.speculation.base import (
    KINDS,
    DraftProvider,
    DraftRowConstraints,
    DraftRowGroup,
    DraftSource,
    KVState,
    Proposal,
    TargetView,
)

__all__ = ["KINDS", "DraftProvider", "DraftRowConstraints", "DraftRowGroup", "DraftSource", "KVState", "Proposal",
           "TargetView"]
