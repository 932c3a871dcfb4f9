"""A newcomer's training script, written against the public names only.

tests/typing/test_user_script.py type-checks it with `mypy --strict` and reads the `reveal_type`
notes: no value that comes from torchplace may be `Any`. The same test runs it on the CPU, so it
stays a working program and not only a typing exercise.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

import torchplace as tp

if TYPE_CHECKING:
    from typing_extensions import reveal_type

SNAPSHOT = "h200x2"  # a reference snapshot shipped with torchplace, by name


def main() -> int:
    rt = tp.setup(device="cpu", seed=0, verbose=False)
    dev = tp.device("cpu")
    model = nn.Linear(4, 2).to(rt.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = tp.precision_for(dev)
    batches = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(3)]
    loader = tp.DeviceLoader(batches, dev)

    with tp.on(dev), tp.strict(model=model), tp.track_memory(dev, warmup_steps=1) as tracker:
        for x, y in loader:
            x, y = tp.to_device((x, y), dev)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]  # torch leaves backward() unannotated
            opt.step()
            tracker.step()

    why = tp.explain(model, torch.randn(2, 4))
    picked = tp.pick(2, snapshot=SNAPSHOT, lease=False)
    with tempfile.TemporaryDirectory() as folder:
        path = tp.save(Path(folder) / "ckpt.tpck", model=model, optimizer=opt, extra={"step": 3})
        ckpt = tp.load(path, device=dev, model=model, optimizer=opt)
    info = tp.dist.init() if "RANK" in os.environ else None

    if TYPE_CHECKING:  # the test reads these notes; none may say Any
        reveal_type(rt)
        reveal_type(dev)
        reveal_type(policy)
        reveal_type(loader)
        reveal_type(tracker)
        reveal_type(why)
        reveal_type(picked)
        reveal_type(path)
        reveal_type(ckpt)
        reveal_type(info)
        reveal_type(tp.to_device)
        reveal_type(tp.dist.init)
        reveal_type(tp.read_facts)
        reveal_type(tp.place)

    print(f"{rt.device} {policy.dtype} {len(picked.gpus)} GPUs picked {ckpt.path.name} "
          f"{len(why)} findings")
    return 0


if __name__ == "__main__":
    sys.exit(main())
