"""Torch-side plumbing that several packages share: the tree walk over nested batches and states (tree.py),
pinned host staging with its side streams and events (staging.py), the helper-thread count (threads.py).

Every layer may import it; it imports only `torchplace.errors` and `torchplace.units`.
"""
