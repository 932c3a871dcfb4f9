"""Facts: what exists on this machine, each question answered once.

`topology.load_topology(snapshot=None)` gives the GPUs of a snapshot or of NVML; `visible.map_visible`
maps cuda:N to physical GPUs; `accelerator.accelerator()` asks torch which accelerator it drives.
Pure reads that never create a CUDA context: NVML for GPUs, text files for versions, and torch only
inside accelerator.py (see its docstring for what each torch call costs). Nothing here imports a
package above it (tests/hardware/test_layering.py).
"""
