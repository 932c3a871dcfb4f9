"""Torch-side plumbing that several packages share: the tree walk over nested batches and states.

Every layer may import it; it imports only `torchplace.errors` and `torchplace.units`.
"""
