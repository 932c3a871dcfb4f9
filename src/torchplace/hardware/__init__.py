"""Facts: what exists on this machine. Pure reads; nothing here initializes CUDA."""
