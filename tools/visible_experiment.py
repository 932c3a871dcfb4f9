"""Ask the driver (and torch) how it reads many CUDA_VISIBLE_DEVICES values; writes JSON.

Run on a GPU machine: python tools/visible_experiment.py OUT.json
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from torchplace.hardware.driver_probe import probe_driver  # noqa: E402
from torchplace.hardware.topology import read_topology  # noqa: E402

topo = read_topology()
u = [g.uuid for g in topo.gpus]
values = ["", " ", ",", "0", "1", "0,1", "1,0", "0,0", "1,1", "0,1,0", "1,0,1", "1,1,0", "0,2", "2", "2,0",
          "-1", "0,-1,1", "0, 1", " 1", "1 ", "1abc", "abc", "0,abc,1", "0,,1", "+1", "01", "0x1", "1.0",
          "GPU-", "MIG-", "MIG-0", "gpu-" + u[0][4:], u[0][4:], u[0], u[0][:12], u[0] + ",0"]
if len(u) > 1:
    values += [u[1] + "," + u[0], u[0] + "," + u[0], "0," + u[1], u[1] + ",0", u[1][:10], "GPU-" + u[1][4:8],
               u[1] + ",GPU-ffffffff", "1," + u[1]]
    # a prefix shared by both GPUs (ambiguous), when they share one
    common = os.path.commonprefix(u)
    if len(common) > 4:
        values.append(common)
# whitespace, letter case, Unicode digits and overflowing numbers (issues 14 and 15)
values += ["\t1", "\n1", " \t1", "1\t", "0 1", "\u00a01", "0,\u00a01", "-0", "00", "0x", " +1", "+-1",
           "\u0661", "\uff11", "\u00b2", "0,\uff11", "0,\u0661", "\u0661,0", "0\u0661", "1\uff11",
           "4294967296", "4294967297", "18446744073709551615", "18446744073709551616", "1" + "0" * 5000,
           "GPU-" + u[0][4:].upper(), "GPU-" + u[0][4:12].upper(), u[0][:8] + u[0][8:12].upper(),
           " " + u[0], u[0] + " ", "\t" + u[0], u[0][:12] + " ", u[0] + "x", "GPU-\uff17fbb"]
# does the driver read a long value whole, cut it, or ignore it? (honoured: [1]; ignored: every GPU)
for n in (255, 256, 1024, 1025, 2624, 2625, 4096):  # 2624/2625: the bound found by bisection
    values += ["1" + " " * (n - 1), " " * (n - 1) + "1"]
values += ["-4294967295", "2147483648", "-2147483648", u[0][:12] + u[0][13:17], u[0][:-1], u[0][:-1] + "x",
           u[0][:6] + "-" + u[0][6:12], u[0][:7], "GPU--" + u[0][4:12], u[0][:12] + "-"]
if len(u) > 1:
    values += [u[0] + ", " + u[1], u[0] + ",  " + u[1][:10], u[0] + "," + "GPU-" + u[1][4:].upper(),
               "0, " + u[1], "0,1,\u0661", "1, \t0"]
results = []


def one(value, order=None, with_torch=False):
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = value
    if order:
        env["CUDA_DEVICE_ORDER"] = order
    view = probe_driver(env)
    rec = {"value": value, "order": order, "driver_uuids": view.uuids, "driver_error": view.error}
    if with_torch:
        code = ("import torch,json;print(json.dumps([torch.cuda.device_count(), "
                "torch.cuda._parse_visible_devices()]))")
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        try:
            cnt, parsed = json.loads(done.stdout.strip().splitlines()[-1])
            rec["torch_device_count"], rec["torch_parse"] = cnt, parsed
        except Exception:
            rec["torch_error"] = done.stderr[-300:]
    return rec


with ThreadPoolExecutor(24) as pool:
    jobs = [pool.submit(one, v, None, True) for v in values]
    jobs += [pool.submit(one, v, "PCI_BUS_ID") for v in ["0", "1", "1,0"]]
    unset_env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    results = [j.result() for j in jobs]
results.append({"value": None, "driver_uuids": probe_driver(unset_env).uuids})
json.dump({"nvml_uuids": u, "results": results}, open(sys.argv[1], "w"), indent=1)
for r in results:
    shown = r["value"] if r["value"] is None or len(r["value"]) < 80 else f"<{len(r['value'])} chars>"
    print(repr(shown), r.get("order"), "->", [u.index(x) if x in u else x for x in (r["driver_uuids"] or [])],
          r.get("driver_error") or "", "torch:", r.get("torch_device_count"), r.get("torch_parse"))
