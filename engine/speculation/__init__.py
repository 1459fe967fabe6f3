"""Speculative decoding: sources of proposed tokens behind one seam (``engine.speculation.base``)
and the verifier that decides every token."""

from mlxkv.engine.speculation.base import (
    KINDS,
    KVState,
    Proposal,
    ProposalProvider,
    ProposalRowGroup,
    ProposalSource,
    RequestConstraints,
    TargetView,
)

__all__ = ["KINDS", "KVState", "Proposal", "ProposalProvider", "ProposalRowGroup", "ProposalSource",
           "RequestConstraints", "TargetView"]
