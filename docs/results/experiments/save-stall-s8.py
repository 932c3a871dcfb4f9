"""Save-stall experiment (issue 34, s8): save_async stall vs the bare pinned copy, per case, old or new code."""
import json, os, shutil, sys, tempfile, time
import torch
from torchplace.bench.checkpoint import gpt2_shapes, llama_shapes, size_shapes, _state
from torchplace.bench.checkpoint_async import measure_stalls
from torchplace.checkpoint.background import save_async

which, cases = sys.argv[1], sys.argv[2].split(",")
dev = torch.device("cuda:0")
torch.cuda.set_device(dev)
shm = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
base = "/dev/shm" if shm > 30 * 2**30 else None
out = {}
shapes = {"gpt2": (gpt2_shapes(), 15), "llama": (llama_shapes(), 5), "1GiB": (size_shapes(2**30), 5),
          "10GiB": (size_shapes(10 * 2**30), 3)}
for name in cases:
    sh, reps = shapes[name]
    state = _state(sh, dev)
    size = sum(t.numel() * 2 for t in state.values())
    root = tempfile.mkdtemp(dir=base)
    try:
        st = measure_stalls(state, size, dev, root, reps, full=False, label=name)
        fut = save_async(os.path.join(root, "x"), model=state, rng_state=False); fut.result()
        fut = save_async(os.path.join(root, "x"), model=state, rng_state=False); fut.result()
        rep = getattr(fut, "repeated", None)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    r = sorted(a / c for a, c in zip(st["async"], st["copy"]))
    out[name] = {"copy_ms": [x * 1e3 for x in st["copy"]], "async_ms": [x * 1e3 for x in st["async"]],
                 "ratios": r, "repeated": rep}
    q = lambda v, p: v[min(len(v) - 1, int(round(p * (len(v) - 1))))]
    print(f"{which} {name}: copy med {sorted(st['copy'])[len(r)//2]*1e3:.3f} ms, async med "
          f"{sorted(st['async'])[len(r)//2]*1e3:.3f} ms, ratio med {q(r,.5):.3f} q1 {q(r,.25):.3f} q3 {q(r,.75):.3f} "
          f"max {r[-1]:.3f} repeated={rep}", flush=True)
    del state
    torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), f"stall-{which}.json"), "w"), indent=1)
