"""A cuda:0 for a machine without one, for `bench diagnose --fake-gpu`: strict() and watch() judged on cuda vs cpu.

What the code puts on a cuda device (a factory's device=, `.to("cuda:0")`, `.cuda()`, a module's move) becomes a
fake tensor there (torch's FakeTensorMode: devices, shapes and dtypes, no data), so torch's own device checks
raise its own errors; everything else stays a real tensor. Autograd cannot record cuda ops on a torch built
without CUDA, so the world runs without grad and a backward pass is simulated: each fake leaf that wants a
gradient gets one on its own device (what an optimizer's step then sees).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_NO_CUDA = ("not linked with support for cuda", "Torch not compiled with CUDA enabled")


def _names_cuda(spec: Any) -> bool:
    try:
        return isinstance(spec, (str, torch.device)) and torch.device(spec).type == "cuda"
    except RuntimeError:
        return False


def _indexed(spec: Any) -> Any:
    """"cuda" as cuda:0 (torch's current device when nothing set another); anything else as it is."""
    return torch.device("cuda", 0) if isinstance(spec, (str, torch.device)) and str(spec) == "cuda" else spec


class FakeCuda(TorchFunctionMode):
    """Runs each torch call that involves cuda on fake tensors (see the module docstring)."""

    def __init__(self) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        super().__init__()
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.leaves: list[torch.Tensor] = []  # not weak: a weak reference stops Module.to() swapping a fake

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.utils._pytree import tree_flatten

        from ..checks._dry_run import _EagerChecks, _on_meta

        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        flat = tree_flatten((args, kwargs))[0]
        if func is torch.Tensor.backward and isinstance(args[0], FakeTensor):
            return self._backward()
        specs = [kwargs.get("device"), *(args[1:] if name == "to" else ())]
        if not (name == "cuda" or any(isinstance(v, FakeTensor) for v in flat) or any(map(_names_cuda, specs))):
            return func(*args, **kwargs)
        if name == "cuda":  # tensor.cuda(1): a .to() with the index made explicit
            spec = args[1] if len(args) > 1 else kwargs.pop("device", None)
            index = spec.index if isinstance(spec, torch.device) else spec if isinstance(spec, int) else None
            func, args = torch.Tensor.to, (args[0], torch.device("cuda", index or 0))
            kwargs.pop("device", None)
        kwargs.update({"device": _indexed(kwargs["device"])} if "device" in kwargs else {})
        args = tuple(_indexed(a) for a in args) if name == "to" else args
        if name == "pin_memory":  # page-locked memory needs the real device: the copy itself is what is judged
            return args[0]
        if name == "__deepcopy__" and isinstance(args[0], FakeTensor):  # torch would copy it under a mode of its own
            return self._copy(args[0], args[1])
        if name == "to" and isinstance(args[0], FakeTensor):  # Module.to() swaps a fake parameter for the moved
            self._forget()  # one, which a weak reference from fake tensors' cache of conversions would refuse
        with self.fake, _EagerChecks():
            try:
                out = func(*args, **kwargs)
            except (RuntimeError, AssertionError) as exc:  # no cuda code for this op here: worked out on meta
                if not any(text in str(exc) for text in _NO_CUDA):
                    raise
                out = _on_meta(func, args, kwargs)
        if name == "requires_grad_" and isinstance(out, FakeTensor):
            self.leaves.append(out)
        return out

    def _copy(self, tensor: torch.Tensor, memo: dict[int, Any]) -> torch.Tensor:
        """copy.deepcopy(TENSOR), a fake of this world's like TENSOR (a parameter stays one)."""
        with self.fake:
            copied = torch.ops.aten.clone.default(tensor)
        if isinstance(tensor, torch.nn.Parameter):
            copied = torch.nn.Parameter(copied, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = copied
        return copied

    def _forget(self) -> None:
        """Empty fake tensors' cache of the tensors they converted (it holds weak references to the fakes)."""
        memo = getattr(getattr(self.fake.fake_tensor_converter, "meta_converter", None), "tensor_memo", None)
        if memo is not None:
            memo.clear()

    def _backward(self) -> None:
        """A backward pass: a gradient (zeros) for each fake leaf that wants one and has none."""
        with self.fake:
            for leaf in self.leaves:
                if leaf.requires_grad and leaf.grad is None:
                    leaf.grad = torch.zeros_like(leaf)


@contextlib.contextmanager
def world() -> Iterator[FakeCuda]:
    """The block builds and runs as if this machine had a cuda:0 (see the module docstring)."""
    mode = FakeCuda()
    with torch.no_grad(), mode:
        yield mode
