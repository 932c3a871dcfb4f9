"""Facts: what exists on this machine, each question answered once.

`topology.load_topology(snapshot=None)` gives the GPUs of a snapshot or of NVML; `visible.map_visible`
maps cuda:N to physical GPUs; `launch.read_launch_env` reads what torchrun, srun, mpirun or Lightning
told this process; `host`, `versions` and `container` read the rest; `facts.read_facts` gathers them
into one record, and `snapshot` holds the snapshot files. `accelerator.accelerator()` asks torch which
accelerator it drives; `driver_probe` asks the CUDA driver itself, in a child process.
Pure reads that never create a CUDA context: NVML for GPUs, text files for versions, and torch only
inside accelerator.py (see its docstring for what each torch call costs). Nothing here imports a
layer above it (tests/test_structure.py).
"""
