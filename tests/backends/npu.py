"""`npu`: a second accelerator type for the tests, a PrivateUse1 back end written in Python.

torch lets a vendor add a device type without changing torch: rename the PrivateUse1 dispatch key
(`torch.utils.rename_privateuse1_backend`), register a device module (`torch.npu`, through
`torch._register_device_module`) and register kernels for that key with `torch.library`. This
module does the same for a device called `npu` (the name Ascend's torch_npu uses), with two
devices, `npu:0` and `npu:1`, whose memory is host memory:

- a tensor on `npu:i` is an `NpuTensor`: a tensor with no storage of its own whose device is
  `npu:i`, holding its data in a host (cpu) tensor, `.host`. Views and in-place ops of the host
  tensor keep the aliasing a real device has (a view of an npu tensor writes through).
- kernels: `torch.library` registrations on the PrivateUse1 key, one per op in `_OPS` (each runs
  the cpu kernel on the host tensors) plus `_copy_from` (copies between npu and cpu and between
  the two npu devices). An op outside `_OPS` fails as it does on an incomplete vendor back end:
  NotImplementedError "Could not run 'aten::...' with arguments from the 'npu' backend".
  Ops given tensors of two devices raise torch's own "Expected all tensors to be on the same
  device" error, as a real device does.
- the device module: availability, count (2), current device per thread (set_device / device),
  synchronize (a no-op: every kernel has finished when it returns), RNG state per device (a cpu
  generator each; torch.manual_seed reaches them), AMP dtypes (fp16, bf16) with autocast kernels
  for the matrix products, and memory_allocated per device.
- what it does NOT have, on purpose, as some real back ends lack them: streams and events (the
  module has no Stream), pinned host memory (`pin_memory()` raises), a memory pool.

Limits of torch 2.13's Python hooks, not of this module: the device guard registered from Python
(`torch._C._acc.DeviceGuard`) always reports device 0, so `torch.accelerator.current_device_index()`
stays 0 and `torch.accelerator.set_device_index()` does nothing; torch.npu.current_device /
set_device (the device module) are the working way to ask and change it.

Registration is process-global and cannot be undone (the PrivateUse1 key can be renamed once, and
`torch.accelerator.current_accelerator()` reports npu from then on, on a CUDA machine too), so the
tests that use it run in a pytest session of their own (tests/backends/test_npu_session.py).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

NAME = "npu"
DEVICE_COUNT = 2
AMP_DTYPES = (torch.float16, torch.bfloat16)

# every aten op the tests run on npu tensors, run on the host tensors by one generic kernel
_OPS = """
empty.memory_format empty_strided
view view.dtype as_strided _reshape_alias unfold detach alias _unsafe_view t transpose.int expand permute select.int
slice.Tensor squeeze squeeze.dim squeeze.dims unsqueeze split.Tensor split_with_sizes unbind.int diagonal
fill_.Scalar fill_.Tensor zero_ clamp clamp_ clamp_min clamp_min_
add.Tensor sub.Tensor mul.Tensor div.Tensor div.Tensor_mode neg abs pow.Tensor_Scalar sqrt rsqrt exp log tanh
sigmoid sign add.out sub.out mul.out div.out
add_.Tensor mul_.Tensor mul_.Scalar sub_.Tensor div_.Tensor addcmul_ addcdiv_ lerp_.Scalar
mm addmm bmm baddbmm dot mm.out addmm.out
relu threshold_backward gelu gelu_backward
sum sum.dim_IntList mean mean.dim amax amin max max.dim min argmax sort
eq.Tensor eq.Scalar ne.Tensor ne.Scalar lt.Scalar gt.Scalar ge.Scalar le.Scalar lt.Tensor gt.Tensor
logical_not bitwise_and.Tensor isnan isinf all all.dims any any.dims
equal _local_scalar_dense
cat index_select index.Tensor index_put_ masked_fill_.Scalar where.self scatter_add_ gather
_log_softmax _log_softmax_backward_data _softmax _softmax_backward_data
nll_loss_forward nll_loss_backward mse_loss mse_loss_backward
native_dropout native_dropout_backward
normal_ uniform_ bernoulli_.float random_ random_.from exponential_
embedding_dense_backward
_foreach_add_.List _foreach_mul_.Scalar _foreach_add_.Scalar _foreach_lerp_.Scalar _foreach_addcmul_.Scalar
_foreach_addcdiv_.Scalar _foreach_sqrt _foreach_div_.List _foreach_mul_.List _foreach_add.List
_foreach_norm.Scalar _foreach_zero_
""".split()

# ops that may mix an npu tensor with a cpu tensor on purpose
_CROSS_DEVICE = {"_copy_from", "_copy_from_and_resize", "index.Tensor", "index_put_", "equal"}
_AUTOCAST_OPS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear")

_state = threading.local()  # the current device, per thread, as the CUDA runtime keeps it
_lock = threading.Lock()
_generators: list[torch.Generator] = []
_live: list[weakref.WeakSet] = []  # npu tensors per device, for memory_allocated
_libraries: list[torch.library.Library] = []  # kept alive: dropping one unregisters its kernels


# -- tensors ------------------------------------------------------------------------------------

class NpuTensor(torch.Tensor):
    """A tensor on npu:i whose data is the host tensor `.host` (same shape, strides, dtype)."""

    host: torch.Tensor

    @staticmethod
    def __new__(cls, host: torch.Tensor, device: torch.device, requires_grad: bool = False) -> NpuTensor:
        t = torch.Tensor._make_wrapper_subclass(
            cls, host.shape, strides=host.stride(), storage_offset=host.storage_offset(), dtype=host.dtype,
            layout=host.layout, device=device, requires_grad=requires_grad)
        t.host = host
        _live[device.index].add(t)
        return t

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # torch asks a tensor of this kind to take part in dispatch; it passes every op on to the
        # kernels registered for the npu key, below, as a tensor of a C++ back end would reach them
        with torch._C._DisableTorchDispatch():
            return func(*args, **(kwargs or {}))

    def __reduce_ex__(self, protocol: Any) -> Any:
        # pickled as torch pickles a tensor of any back end without storage: its data through the
        # cpu, its device by name; no trace of this class, so torch.load(weights_only=True) reads it
        return (torch._utils._rebuild_device_tensor_from_cpu_tensor,
                (self.detach().cpu(), self.dtype, str(self.device), self.requires_grad))

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return repr(self.host).replace("tensor(", "npu_tensor(", 1)[:-1] + f", device='{self.device}')"


def _index(device: Any) -> int:
    """The npu index DEVICE names (None or a bare 'npu': the thread's current device)."""
    if device is None:
        return current_device()
    if isinstance(device, int):
        index = device
    else:
        dev = torch.device(device)
        if dev.type != NAME:
            raise ValueError(f"{dev} is not an {NAME} device")
        index = dev.index if dev.index is not None else current_device()
    if not 0 <= index < DEVICE_COUNT:
        raise RuntimeError(f"{NAME}:{index}: invalid device ordinal; {DEVICE_COUNT} {NAME} devices exist "
                           f"({NAME}:0..{NAME}:{DEVICE_COUNT - 1})")
    return index


def _same_device(name: str, tensors: list[torch.Tensor]) -> None:
    """Raise torch's own message when an op is given tensors of two devices."""
    first = None
    for t in tensors:
        if t.device.type == "cpu" and t.dim() == 0:  # a cpu scalar goes with any device, as on cuda
            continue
        if first is None:
            first = t.device
        elif t.device != first:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two "
                               f"devices, {first} and {t.device}! (aten::{name} on the {NAME} test back end)")


def _kernel(op: Any) -> Any:
    """The kernel of OP on npu: OP's cpu kernel on the host tensors, results wrapped on the device."""
    name = op.__name__.removesuffix(".default")  # "addmm.out", as _OPS names it
    random = any(a.name == "generator" for a in op._schema.arguments)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        flat, _ = tree_flatten((args, kwargs))
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        if name not in _CROSS_DEVICE:
            _same_device(name, tensors)
        npus = [t for t in tensors if isinstance(t, NpuTensor)]
        device = npus[0].device if npus else None
        if "device" in kwargs and kwargs["device"] is not None:
            device = torch.device(NAME, _index(kwargs["device"]))
            kwargs = {**kwargs, "device": torch.device("cpu")}
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        if device is None:
            device = torch.device(NAME, current_device())
        if random and kwargs.get("generator") is None:
            kwargs = {**kwargs, "generator": _generators[device.index]}
        hosts = {id(t.host): t for t in npus}
        out = op(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        return tree_map(lambda o: _wrap(o, device, hosts), out)

    return kernel


def _unwrap(x: Any) -> Any:
    return x.host if isinstance(x, NpuTensor) else x


def _wrap(o: Any, device: torch.device, hosts: dict[int, NpuTensor]) -> Any:
    if not isinstance(o, torch.Tensor):
        return o
    same = hosts.get(id(o))  # an in-place or out= op returns its argument: hand back the npu tensor
    return same if same is not None else NpuTensor(o, device)


def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """Copies npu -> cpu, cpu -> npu and npu:i -> npu:j (synchronous whatever non_blocking says)."""
    (dst.host if isinstance(dst, NpuTensor) else dst).copy_(_unwrap(src))
    return dst


def _copy_from_and_resize(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    if tuple(dst.shape) != tuple(src.shape):
        raise NotImplementedError(f"{NAME} tensors cannot be resized (test back end): out= of shape "
                                  f"{tuple(dst.shape)} given for a result of shape {tuple(src.shape)}")
    return _copy_from(src, dst)


def _resize_(self: torch.Tensor, size: list[int], memory_format: Any = None) -> torch.Tensor:
    """Only to the size it has: the shape of a tensor without storage is fixed when it is made."""
    if list(self.shape) != list(size):
        raise NotImplementedError(f"{NAME} tensors cannot be resized (test back end): {tuple(self.shape)} -> "
                                  f"{tuple(size)}; an op that needs it is not supported here")
    return self


def _autocast_kernel(op: Any) -> Any:
    """Run OP in the autocast dtype, as CUDA's autocast does for matrix products."""
    exclude = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        dtype = torch.get_autocast_dtype(NAME)

        def cast(x: Any) -> Any:
            return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.device.type == NAME else x

        with torch._C._ExcludeDispatchKeyGuard(exclude):
            return op(*tree_map(cast, args), **tree_map(cast, kwargs))

    return kernel


# -- the device module (torch.npu) ---------------------------------------------------------------

def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return DEVICE_COUNT


def current_device() -> int:
    return getattr(_state, "index", 0)


def set_device(device: Any) -> None:
    _state.index = _index(device)


class device:
    """`with torch.npu.device(i):` makes npu:i current for the block, as torch.cuda.device does."""

    def __init__(self, device: Any) -> None:
        self.index = _index(device) if device is not None and device != -1 else None
        self.previous: int | None = None

    def __enter__(self) -> None:
        if self.index is not None:
            self.previous = current_device()
            set_device(self.index)

    def __exit__(self, *exc: Any) -> None:
        if self.previous is not None:
            set_device(self.previous)


def synchronize(device: Any = None) -> None:
    """Nothing to wait for: every npu kernel has finished when it returns."""
    _index(device)


def get_device_name(device: Any = None) -> str:
    return f"torchplace test NPU {_index(device)} (host memory)"


def get_amp_supported_dtype() -> list[torch.dtype]:
    return list(AMP_DTYPES)


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def get_rng_state(device: Any = NAME) -> torch.Tensor:
    return _generators[_index(device)].get_state()


def set_rng_state(new_state: torch.Tensor, device: Any = NAME) -> None:
    _generators[_index(device)].set_state(new_state.cpu())


def get_rng_state_all() -> list[torch.Tensor]:
    return [g.get_state() for g in _generators]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for g, state in zip(_generators, new_states):
        g.set_state(state.cpu())


def manual_seed(seed: int) -> None:
    _generators[current_device()].manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    for g in _generators:
        g.manual_seed(int(seed))


def seed() -> None:
    _generators[current_device()].seed()


def seed_all() -> None:
    for g in _generators:
        g.seed()


def initial_seed() -> int:
    return _generators[current_device()].initial_seed()


def memory_allocated(device: Any = None) -> int:
    """Bytes held by the live npu tensors of DEVICE (each storage counted once)."""
    seen: dict[int, int] = {}
    for t in list(_live[_index(device)]):
        storage = t.host.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


# -- registration ----------------------------------------------------------------------------------

def registered() -> bool:
    """True when this process has the npu back end."""
    return torch._C._get_privateuse1_backend_name() == NAME and bool(_libraries)


def register() -> None:
    """Make `npu` a device type of this process (idempotent; it cannot be undone)."""
    with _lock:
        if _libraries:
            return
        current = torch._C._get_privateuse1_backend_name()
        if current not in ("privateuseone", NAME):
            raise RuntimeError(f"PrivateUse1 is already the {current!r} back end in this process; "
                               f"the test back end {NAME!r} needs it")
        if current != NAME:
            torch.utils.rename_privateuse1_backend(NAME)
        _generators[:] = [torch.Generator() for _ in range(DEVICE_COUNT)]
        _live[:] = [weakref.WeakSet() for _ in range(DEVICE_COUNT)]
        torch._register_device_module(NAME, _module())
        torch.utils.generate_methods_for_privateuse1_backend(for_storage=False)
        torch._C._acc.register_python_privateuseone_hook(_Hooks())
        torch._C._acc.register_python_privateuseone_device_guard(_Guard())
        aten = torch.library.Library("aten", "IMPL")
        for qualified in _OPS:
            base, _, overload = qualified.partition(".")
            op = getattr(getattr(torch.ops.aten, base), overload or "default")
            aten.impl(qualified, _kernel(op), "PrivateUse1")
        aten.impl("_copy_from", _copy_from, "PrivateUse1")
        aten.impl("_copy_from_and_resize", _copy_from_and_resize, "PrivateUse1")
        aten.impl("resize_", _resize_, "PrivateUse1")
        # autocast: every op passes through, but the matrix products run in the autocast dtype
        anything = torch.library.Library("_", "IMPL")
        anything.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
        _libraries.append(anything)
        for name in _AUTOCAST_OPS:
            aten.impl(name, _autocast_kernel(getattr(torch.ops.aten, name).default), "AutocastPrivateUse1")
        _libraries.append(aten)


def _module() -> Any:
    import types

    mod = types.ModuleType(f"torch.{NAME}", "The npu test back end's device module (tests/backends/npu.py).")
    for name in ("is_available", "is_initialized", "_is_in_bad_fork", "device_count", "current_device",
                 "set_device", "device", "synchronize", "get_device_name", "get_amp_supported_dtype",
                 "is_bf16_supported", "get_rng_state", "set_rng_state", "get_rng_state_all",
                 "set_rng_state_all", "manual_seed", "manual_seed_all", "seed", "seed_all", "initial_seed",
                 "memory_allocated"):
        setattr(mod, name, globals()[name])
    return mod


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, device_index: int) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _Guard(torch._C._acc.DeviceGuard):
    def type_(self) -> Any:
        return torch._C._autograd.DeviceType.PrivateUse1


@contextlib.contextmanager
def on_device(index: int) -> Iterator[None]:
    """The device module's own scope, for tests that want it without torchplace."""
    with device(index):
        yield
