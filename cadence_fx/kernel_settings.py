"""The one table of process settings that pick which kernel eager runs, hence which bits it makes.

A CUDA graph replays the kernels chosen when it was captured; a hoisted constant holds the bits the
kernels of ``optimize`` made. Both are exact only while every setting that steers kernel choice is
what it was then. Three places need the same list and read it from here: the replay key
(:meth:`cadence_fx.runtime.exact_replay.ExactShapeReplay.signature`, on every call: a changed setting is a new
class, captured again in the next warm-up and run eagerly until then), the artifact check
(:func:`cadence_fx.artifact.load` refuses an artifact built under other settings) and the
determinism envelope (:func:`cadence_fx.determinism.envelope_settings`, printed next to results).

What the settings change:

- TF32 and fp32 precision (``cuda.matmul.allow_tf32``, ``cudnn.allow_tf32``,
  ``float32_matmul_precision``, the ``*.fp32_precision`` family of torch >= 2.9): whether fp32
  products and convolutions run on TF32 (cuBLAS, cuDNN) or bf16 (oneDNN on the CPU) tensor cores,
  a 10-bit or 7-bit mantissa instead of 23. The legacy flags and the new family are views of one
  state; both are keyed (a process that mixed the two APIs cannot read the legacy ones: they read
  as ``"unreadable"``).
- Reduced-precision reductions and accumulation (``cuda.matmul.allow_{fp16,bf16}_reduced_precision
  _reduction`` and their split-K halves, ``allow_fp16_accumulation``, ``cpu.allow_fp16_reduced_
  precision_reduction``): which cuBLAS kernels (split-K, fp16 accumulators) half-precision products
  may use.
- cuDNN (``enabled``, ``deterministic``, ``benchmark``, ``benchmark_limit``, ``depthwise_kernel``):
  whether convolutions go to cuDNN or the native kernels, and which cuDNN algorithm is taken
  (benchmarking times candidates and keeps the fastest, which can differ run to run).
- Attention (``sdpa.*``): the backends ``scaled_dot_product_attention`` may dispatch to (flash,
  memory-efficient, math, cuDNN, FA3, a device's own) and in what order; each sums in its own order.
  This project found cuDNN attention's bits differ between processes (moshi on an H200).
- Autocast per device type, on/off and dtype: which ops run in which precision.
- Preferred BLAS (cuBLAS / cuBLASLt / CK), linalg (cuSOLVER / MAGMA) and ROCm attention libraries,
  and the SM carveout of matmuls: different libraries and grid sizes, different summation orders.
- oneDNN (``mkldnn.enabled``, ``mkldnn.deterministic``) and NNPACK on the CPU.
- ``use_deterministic_algorithms`` (and warn-only) and ``torch.utils.deterministic.
  fill_uninitialized_memory``: deterministic variants of scatter/index kernels, an error or a
  warning where none exists, extra fill kernels on every new tensor.

Each entry reads its setting without starting a device or loading a library (the getters read
``at::Context`` fields; on ROCm builds the first read of the preferred BLAS or attention library
asks the HIP runtime for the device count). Entries whose getter this torch lacks are left out of
the table, so the table is this torch's. Values in :func:`snapshot` are JSON (dtypes and library
enums as their names); :func:`key` keeps the raw hashable values and is cheap enough for every call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

__all__ = ["TABLE", "UNREADABLE", "KernelSetting", "SettingDiff", "apply", "diff", "key", "settle", "snapshot"]

_C = torch._C
UNREADABLE = "unreadable"  # the value of a setting whose getter raised (mixed TF32 APIs)
_settled: set[tuple[str, int | None]] = set()


def settle(device: torch.device | str) -> None:
    """Make the settings a torch build sets at their first use on a device read as every later call
    will see them: one tiny attention call there, once per device and process.

    On an H200 (torch 2.11) an artifact saved by a process that had run attention on the GPU recorded
    ``sdpa.priority_order`` ``[3, 1, 2, 0, 4]`` (cuDNN first, as torch prefers on that GPU), and a fresh
    process loading it, which had not yet run attention, read ``[1, 2, 0, 3, 4]``: nothing the user
    set differed. A comparison or a replay key taken before the first attention call would differ
    from one taken after it.
    """
    dev = torch.device(device)
    if dev.type != "cuda" or (dev.type, dev.index) in _settled:
        return
    _settled.add((dev.type, dev.index))
    q = torch.zeros(1, 1, 1, 8, device=dev)
    with torch.no_grad():
        torch.nn.functional.scaled_dot_product_attention(q, q, q)


@dataclass(frozen=True)
class KernelSetting:
    """One setting that picks kernels.

    ``read`` returns the raw value (hashable: bool, str, int, None, tuple, dtype or library enum) and
    touches no device; ``write`` sets it from its :func:`snapshot` (JSON) form; ``how`` is the user's
    way to set it, with ``{v}`` for that form; ``devices``: the device types whose kernels it picks;
    ``choices``: the JSON forms it takes where not a bool (empty: a bool, or open-ended).
    """

    name: str
    read: Callable[[], object]
    write: Callable[[Any], object]
    how: str
    devices: tuple[str, ...]
    choices: tuple[object, ...] = ()

    def value(self) -> object:
        """The current value in JSON form (``"unreadable"`` when the getter raises)."""
        try:
            return _json(self.read())
        except Exception:  # noqa: BLE001 - torch refuses the legacy TF32 flags after mixed API use
            return UNREADABLE

    def set_how(self, v: object) -> str:
        """How to set this setting to ``v`` (a JSON form), as a line of Python."""
        return self.how.format(v=v)


@dataclass(frozen=True)
class SettingDiff:
    """A setting whose saved value differs from the current one; ``how`` sets it back to ``saved``."""

    name: str
    saved: object
    now: object
    how: str
    devices: tuple[str, ...]


def _json(v: object) -> object:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, torch.dtype):
        return str(v).removeprefix("torch.")
    if isinstance(v, (tuple, list)):
        return [_json(x) for x in v]
    name = getattr(v, "name", None)  # the library enums (_BlasBackend.Cublas -> "cublas", as the setters take)
    return name.lower() if isinstance(name, str) else str(v)


def _c(name: str) -> Callable[..., Any] | None:
    return getattr(_C, name, None)


def _pair(getter: Callable[[], tuple[bool, bool]], i: int) -> Callable[[], object]:
    """One half of a cuBLAS reduction option (allow reduced precision, allow split-K)."""
    return lambda: getter()[i]


def _bool_option(name: str, getter: str, setter: Callable[[Any], object] | None, how: str,
                 devices: tuple[str, ...]) -> KernelSetting | None:
    """A setting read by the ``torch._C`` getter of that name; None where this torch lacks either half."""
    read = _c(getter)
    return None if read is None or setter is None else KernelSetting(name, read, setter, how, devices)


def _reductions() -> list[KernelSetting | None]:
    """cuBLAS's reduced-precision reductions: (allow, allow split-K) pairs where the getter returns them
    (torch 2.11 does), a bool before; the legacy names hold the first half, as the public flags do."""
    out: list[KernelSetting | None] = []
    matmul = torch.backends.cuda.matmul
    for half in ("fp16", "bf16"):
        getter = _c(f"_get_cublas_allow_{half}_reduced_precision_reduction")
        if getter is None:
            continue
        attr = f"allow_{half}_reduced_precision_reduction"
        paired = isinstance(getter(), tuple)
        out.append(KernelSetting(
            f"cuda.matmul.{attr}", _pair(getter, 0) if paired else getter,
            functools.partial(setattr, matmul, attr), f"torch.backends.cuda.matmul.{attr} = {{v}}", ("cuda",)))
        if paired:
            def write_splitk(v: bool, getter: Callable[[], tuple[bool, bool]] = getter, attr: str = attr) -> None:
                setattr(matmul, attr, (getter()[0], v))
            out.append(KernelSetting(
                f"cuda.matmul.{attr}_split_k", _pair(getter, 1), write_splitk,
                f"torch.backends.cuda.matmul.{attr} = (torch.backends.cuda.matmul.{attr}, {{v}})", ("cuda",)))
    return out


def _fp32_precisions() -> list[KernelSetting]:
    """The fp32 precision family (torch >= 2.9): one entry per (backend, op) pair this torch accepts."""
    getter, setter = _c("_get_fp32_precision_getter"), _c("_set_fp32_precision_setter")
    if getter is None or setter is None:
        return []
    out = []
    for name, backend, op, how, devices in (
            ("fp32_precision", "generic", "all", "torch.backends.fp32_precision = {v!r}", ("cpu", "cuda")),
            ("cuda.fp32_precision", "cuda", "all", "torch.backends.cudnn.fp32_precision = {v!r}", ("cuda",)),
            ("cuda.matmul.fp32_precision", "cuda", "matmul", "torch.backends.cuda.matmul.fp32_precision = {v!r}",
             ("cuda",)),
            ("cudnn.conv.fp32_precision", "cuda", "conv", "torch.backends.cudnn.conv.fp32_precision = {v!r}",
             ("cuda",)),
            ("cudnn.rnn.fp32_precision", "cuda", "rnn", "torch.backends.cudnn.rnn.fp32_precision = {v!r}", ("cuda",)),
            # torch.backends.mkldnn.fp32_precision's setter writes the generic value: the setter named here
            ("mkldnn.fp32_precision", "mkldnn", "all", 'torch._C._set_fp32_precision_setter("mkldnn", "all", {v!r})',
             ("cpu",)),
            ("mkldnn.matmul.fp32_precision", "mkldnn", "matmul", "torch.backends.mkldnn.matmul.fp32_precision = {v!r}",
             ("cpu",)),
            ("mkldnn.conv.fp32_precision", "mkldnn", "conv", "torch.backends.mkldnn.conv.fp32_precision = {v!r}",
             ("cpu",)),
            ("mkldnn.rnn.fp32_precision", "mkldnn", "rnn", "torch.backends.mkldnn.rnn.fp32_precision = {v!r}",
             ("cpu",))):
        try:
            getter(backend, op)
        except RuntimeError:  # a pair this torch does not know
            continue
        choices = ("none", "ieee", "tf32", "bf16") if backend == "mkldnn" else ("none", "ieee", "tf32")
        out.append(KernelSetting(name, functools.partial(getter, backend, op),
                                 functools.partial(setter, backend, op), how, devices, choices))
    return out


def _autocast() -> list[KernelSetting]:
    out = []
    for dev in ("cpu", "cuda"):
        out.append(KernelSetting(f"autocast.{dev}.enabled", functools.partial(torch.is_autocast_enabled, dev),
                                 functools.partial(torch.set_autocast_enabled, dev),
                                 f'torch.set_autocast_enabled("{dev}", {{v}})  # or a torch.autocast("{dev}") block',
                                 (dev,)))
        out.append(KernelSetting(
            f"autocast.{dev}.dtype", functools.partial(torch.get_autocast_dtype, dev),
            lambda v, dev=dev: torch.set_autocast_dtype(dev, getattr(torch, v)),
            f'torch.set_autocast_dtype("{dev}", torch.{{v}})', (dev,), ("float16", "bfloat16")))
    return out


def _deterministic(v: bool) -> None:
    torch.use_deterministic_algorithms(v, warn_only=_C._get_deterministic_algorithms_warn_only())


def _warn_only(v: bool) -> None:
    torch.use_deterministic_algorithms(_C._get_deterministic_algorithms(), warn_only=v)


def _fill(v: bool) -> None:
    torch.utils.deterministic.fill_uninitialized_memory = v  # type: ignore[attr-defined]


def _priority() -> tuple[int, ...]:
    return tuple(_C._get_sdp_priority_order())


def _sdpa() -> list[KernelSetting | None]:
    cuda = torch.backends.cuda
    out: list[KernelSetting | None] = [
        # the first four keep the artifact's names of cadence_fx <= 0.1 (manifests store them)
        _bool_option("sdpa.cudnn", "_get_cudnn_sdp_enabled", cuda.enable_cudnn_sdp,
                     "torch.backends.cuda.enable_cudnn_sdp({v})", ("cuda",)),
        # the flash flag also gates the CPU's flash kernel
        _bool_option("sdpa.flash", "_get_flash_sdp_enabled", cuda.enable_flash_sdp,
                     "torch.backends.cuda.enable_flash_sdp({v})", ("cpu", "cuda")),
        _bool_option("sdpa.mem_efficient", "_get_mem_efficient_sdp_enabled", cuda.enable_mem_efficient_sdp,
                     "torch.backends.cuda.enable_mem_efficient_sdp({v})", ("cuda",)),
        _bool_option("sdpa.math", "_get_math_sdp_enabled", cuda.enable_math_sdp,
                     "torch.backends.cuda.enable_math_sdp({v})", ("cpu", "cuda")),
        _bool_option("sdpa.fa3", "_get_fa3_sdp_enabled", _c("_set_sdp_use_fa3"),
                     "torch._C._set_sdp_use_fa3({v})", ("cuda",)),
        _bool_option("sdpa.overrideable", "_get_overrideable_sdp_enabled", _c("_set_sdp_use_overrideable"),
                     "torch._C._set_sdp_use_overrideable({v})", ("privateuseone",)),
        _bool_option("sdpa.math_fp16_bf16_reduction", "_get_math_sdp_allow_fp16_bf16_reduction",
                     _c("_set_math_sdp_allow_fp16_bf16_reduction"),
                     "torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp({v})", ("cpu", "cuda")),
    ]
    if _c("_get_sdp_priority_order") and _c("_set_sdp_priority_order"):
        # torch.nn.attention.SDPBackend values, the first eligible backend wins
        out.append(KernelSetting("sdpa.priority_order", _priority, _C._set_sdp_priority_order,
                                 "torch._C._set_sdp_priority_order({v})", ("cuda",)))
    return out


def _libraries() -> list[KernelSetting | None]:
    cuda = torch.backends.cuda
    out: list[KernelSetting | None] = []
    for name, getter, public, choices, devices in (
            ("cuda.preferred_blas_library", "_get_blas_preferred_backend", "preferred_blas_library",
             ("cublas", "cublaslt", "ck"), ("cuda",)),
            ("cuda.preferred_linalg_library", "_get_linalg_preferred_backend", "preferred_linalg_library",
             ("default", "cusolver", "magma"), ("cuda",)),
            ("cuda.preferred_rocm_fa_library", "_get_rocm_fa_preferred_backend", "preferred_rocm_fa_library",
             ("default", "aotriton", "ck"), ("cuda",))):
        read, write = _c(getter), getattr(cuda, public, None)
        if read is not None and write is not None:
            out.append(KernelSetting(name, read, write, f"torch.backends.cuda.{public}({{v!r}})", devices, choices))
    carveout = _c("_get_sm_carveout_experimental")
    if carveout is not None and _c("_set_sm_carveout_experimental"):
        out.append(KernelSetting("cuda.sm_carveout", carveout, _C._set_sm_carveout_experimental,
                                 "torch._C._set_sm_carveout_experimental({v})", ("cuda",)))
    return out


def _cudnn() -> list[KernelSetting | None]:
    out: list[KernelSetting | None] = [
        _bool_option("cudnn.enabled", "_get_cudnn_enabled", _c("_set_cudnn_enabled"),
                     "torch.backends.cudnn.enabled = {v}", ("cuda",)),
        _bool_option("cudnn.deterministic", "_get_cudnn_deterministic", _c("_set_cudnn_deterministic"),
                     "torch.backends.cudnn.deterministic = {v}", ("cuda",)),
        _bool_option("cudnn.benchmark", "_get_cudnn_benchmark", _c("_set_cudnn_benchmark"),
                     "torch.backends.cudnn.benchmark = {v}", ("cuda",)),
    ]
    if _c("_cuda_get_cudnn_benchmark_limit") and _c("_cuda_set_cudnn_benchmark_limit"):  # CUDA builds only
        out.append(KernelSetting("cudnn.benchmark_limit", _C._cuda_get_cudnn_benchmark_limit,
                                 _C._cuda_set_cudnn_benchmark_limit, "torch.backends.cudnn.benchmark_limit = {v}",
                                 ("cuda",)))
    if _c("_get_cudnn_depthwise_kernel") and _c("_set_cudnn_depthwise_kernel"):
        out.append(KernelSetting("cudnn.depthwise_kernel", _C._get_cudnn_depthwise_kernel,
                                 _C._set_cudnn_depthwise_kernel, "torch.backends.cudnn.depthwise_kernel = {v!r}",
                                 ("cuda",), ("auto", "cudnn", "native")))
    if _c("_get_miopen_immediate") and _c("_set_miopen_immediate"):  # ROCm's convolution library
        out.append(KernelSetting("miopen.immediate", _C._get_miopen_immediate, _C._set_miopen_immediate,
                                 "torch.backends.miopen.immediate = {v}", ("cuda",)))
    return out


def _build() -> tuple[KernelSetting, ...]:
    matmul = torch.backends.cuda.matmul
    # order matters to apply(): the legacy TF32 flags first, the fp32 precision family (which they
    # write through) after them, so that writing a snapshot back restores the family exactly
    entries: list[KernelSetting | None] = [
        _bool_option("cuda.matmul.allow_tf32", "_get_cublas_allow_tf32", _c("_set_cublas_allow_tf32"),
                     "torch.backends.cuda.matmul.allow_tf32 = {v}", ("cuda",)),
        _bool_option("cudnn.allow_tf32", "_get_cudnn_allow_tf32", _c("_set_cudnn_allow_tf32"),
                     "torch.backends.cudnn.allow_tf32 = {v}", ("cuda",)),
        KernelSetting("float32_matmul_precision", _C._get_float32_matmul_precision, torch.set_float32_matmul_precision,
                      "torch.set_float32_matmul_precision({v!r})", ("cpu", "cuda"), ("highest", "high", "medium")),
        *_fp32_precisions(),
        *_reductions(),
        _bool_option("cuda.matmul.allow_fp16_accumulation", "_get_cublas_allow_fp16_accumulation",
                     functools.partial(setattr, matmul, "allow_fp16_accumulation"),
                     "torch.backends.cuda.matmul.allow_fp16_accumulation = {v}", ("cuda",)),
        _bool_option("cpu.allow_fp16_reduced_precision_reduction", "_get_cpu_allow_fp16_reduced_precision_reduction",
                     _c("_set_cpu_allow_fp16_reduced_precision_reduction"),
                     "torch._C._set_cpu_allow_fp16_reduced_precision_reduction({v})", ("cpu",)),
        *_cudnn(),
        *_sdpa(),
        *_autocast(),
        *_libraries(),
        _bool_option("mkldnn.enabled", "_get_mkldnn_enabled", _c("_set_mkldnn_enabled"),
                     "torch.backends.mkldnn.enabled = {v}", ("cpu",)),
        _bool_option("mkldnn.deterministic", "_get_mkldnn_deterministic", _c("_set_mkldnn_deterministic"),
                     "torch.backends.mkldnn.deterministic = {v}", ("cpu",)),
        _bool_option("nnpack.enabled", "_get_nnpack_enabled", _c("_set_nnpack_enabled"),
                     "torch.backends.nnpack.set_flags({v})", ("cpu",)),
        KernelSetting("deterministic_algorithms", _C._get_deterministic_algorithms, _deterministic,
                      "torch.use_deterministic_algorithms({v})", ("cpu", "cuda")),
        KernelSetting("deterministic_algorithms.warn_only", _C._get_deterministic_algorithms_warn_only, _warn_only,
                      "torch.use_deterministic_algorithms(torch.are_deterministic_algorithms_enabled(), "
                      "warn_only={v})", ("cpu", "cuda")),
        _bool_option("fill_uninitialized_memory", "_get_deterministic_fill_uninitialized_memory", _fill,
                     "torch.utils.deterministic.fill_uninitialized_memory = {v}", ("cpu", "cuda")),
    ]
    table = tuple(e for e in entries if e is not None)
    names = [e.name for e in table]
    assert len(set(names)) == len(names), names
    return table


TABLE: tuple[KernelSetting, ...] = _build()
_BY_NAME: dict[str, KernelSetting] = {s.name: s for s in TABLE}
_READERS: tuple[Callable[[], object], ...] = tuple(s.read for s in TABLE)


def key() -> tuple:
    """Every setting's raw value, in table order: hashable, for the per-call replay key (a few
    microseconds: each getter is a C function or one call around one)."""
    try:
        return tuple([read() for read in _READERS])
    except Exception:  # noqa: BLE001 - a legacy TF32 getter refusing after mixed API use
        return tuple(_read_or_unreadable(read) for read in _READERS)


def _read_or_unreadable(read: Callable[[], object]) -> object:
    try:
        return read()
    except Exception:  # noqa: BLE001
        return UNREADABLE


def snapshot() -> dict[str, object]:
    """Every setting's current value by name, JSON-serializable (dtypes and library enums as names)."""
    return {s.name: s.value() for s in TABLE}


def diff(saved: Mapping[str, object]) -> list[SettingDiff]:
    """The settings whose value in ``saved`` (a :func:`snapshot`, e.g. from an artifact's manifest)
    differs from the current one. Names this table lacks (another torch, a newer cadence_fx) are
    ignored; table entries ``saved`` lacks (an older writer) are not compared, nor are values saved
    as ``"unreadable"`` (a legacy TF32 flag after mixed API use: the fp32 precision entries, which
    are compared, hold the state it is a view of)."""
    out = []
    for name, was in saved.items():
        setting = _BY_NAME.get(name)
        if setting is None or was == UNREADABLE:
            continue
        now = setting.value()
        if now != was:
            out.append(SettingDiff(name, was, now, setting.set_how(was), setting.devices))
    return out


def apply(saved: Mapping[str, object]) -> list[SettingDiff]:
    """Write back the settings of ``saved`` that differ (names this table lacks and unreadable values
    are skipped); returns what still differs afterwards (a value this build refuses)."""
    for _ in range(3):  # the TF32 views write through to each other: a second pass settles them
        pending = diff(saved)
        if not pending:
            return []
        for d in pending:
            try:
                _BY_NAME[d.name].write(d.saved)
            except (RuntimeError, ValueError, TypeError):  # not settable in this build (cuBLASLt, MAGMA)
                pass
    return diff(saved)
