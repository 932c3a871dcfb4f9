"""Torch-side plumbing that several packages share.

- `tree.py`: the tree walk over nested batches and states (`map_tensors`, `walk`);
- `wrappers.py`: seeing through DDP / DataParallel / torch.compile / Fabric wrappers (`unwrap`, `meta_names`);
- `frames.py`: the user's frame, the first one outside torch and torchplace;
- `setters.py`: the one recorder of torch's device setters (guard and strict's leak check watch it);
- `strict_switch.py`: the strict-mode switch that checks turn and memory and amp read;
- `staging.py`: pinned host staging with its side streams and events;
- `threads.py`: the helper-thread count.

Every layer may import it; it imports only `torchplace.errors`, `torchplace.units` and torch.
"""
