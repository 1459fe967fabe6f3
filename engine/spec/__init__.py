"""Speculative decoding: sources of proposed tokens behind one seam (``engine.spec.base``)
and the verifier that decides every token."""

from engine.spec.base import (
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
