"""The adapter contract and the registry every implementation joins with one decorator.

An implementation is a *prepare* function::

    @register("my-kernel", family="triton", dtypes=HALF, devices=("cuda",))
    def my_kernel(q, k, v, *, causal: bool, scale: float) -> Prepared | Callable[[], Tensor]:
        ...  # layout changes, descriptors, autotuning: everything that is not the kernel
        return Prepared(lambda: launch(...), config={"BLOCK_M": 128})

``q`` is ``(B, Hq, Sq, D)``, ``k`` and ``v`` are ``(B, Hkv, Skv, D)``; the returned callable computes
``o (B, Hq, Sq, D)`` in q's dtype and is the only thing a benchmark times. The registry validates the
inputs (``impls.contract``) and the declared capabilities before calling the prepare function, so an
adapter only raises :class:`Unsupported` for what is particular to it. Every tensor it gets has its head dim
(the last) at unit stride, and the serving operations' index tensors are contiguous: one that is not arrives as
a contiguous copy, made then, out of any timed region (``unit_head_stride``, ``PagedKV.in_kernel_layout``).

Beside dense forward (``op="dense"``) there are the serving operations of ``impls.contract``: ``"paged"``
(decode over a paged KV cache), ``"varlen"`` (packed variable-length prefill), ``"mla"`` (MLA decode over a
paged latent cache) and ``"mixed"`` (prefill chunks and decode steps in one batch over a paged KV cache). Their
prepare functions take the validated inputs object and the scale::

    @register("my-kernel", op="paged", family="triton", dtypes=HALF, devices=("cuda",))
    def my_decode(inputs: PagedKV, *, scale: float) -> Prepared: ...

A window or softcap reaches a prepare function, as ``window=`` / ``softcap=``, of any operation only where it
declares the variant (``variants=("window", "softcap")``); a paged batch with an fp8 cache reaches only those
that declare ``"kv_fp8"``, and a backward or training step over packed documents (``cu_seqlens``) only those that
declare ``"packed"``.

The backward pass (``op="backward"``) takes a ``Backward`` the same way and returns ``(dq, dk, dv)``; an
implementation that reads the forward's log-sum-exp declares ``needs=("lse",)``, and inputs without one are refused;
it names the forward a training step runs before it with ``forward=``, a prepare function over ``(q, k, v)``
whose call writes ``(o, lse)`` into the same buffers each time. A training step (``op="fwdbwd"``, a
``ForwardBackward``: the forward, then the backward, timed as one call) is made for every backward entry once
every module is imported (``impls.backward``), so a backward needs no second registration.

One name may be registered once per operation (``naive`` is all of them).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Protocol

import torch

from impls.contract import NO_WINDOW, unit_head_stride, validate_attention_inputs, validate_variants

# What a model may ask of attention beyond causal (impls.reference): a sliding window and softcap (options of the
# call), a value head dim other than the query/key one (a property of dense inputs: MLA's Dv 128, Dqk 192), and an
# fp8 KV cache (a property of paged-decode inputs: impls.contract.PagedKV), and documents packed with cu_seqlens (a
# property of the training ops' inputs: impls.contract.Backward, as long-context training packs its batches).
VARIANTS = ("window", "softcap", "value_dim", "kv_fp8", "packed")

Runner = Callable[[], torch.Tensor]

# mla: impls.contract.MLADecode; mixed: MixedBatch; fwdbwd: ForwardBackward (a training step)
OPS = ("dense", "paged", "varlen", "mla", "mixed", "backward", "fwdbwd")
HALF = (torch.float16, torch.bfloat16)
FLOATS = (torch.float16, torch.bfloat16, torch.float32)


class Unsupported(ValueError):
    """This implementation cannot run this case here; the message is the human reason."""


GRID_AXIS_MAX = 65535  # CUDA's cap on a launch grid's second and third axes (the first takes 2**31 - 1)


def check_grid_axis(programs: int, what: str) -> None:
    """Refuse a launch whose grid puts ``programs`` (``what`` they count) on an axis CUDA caps at GRID_AXIS_MAX, with
    the limit named, where CUDA would answer "invalid argument"."""
    if programs > GRID_AXIS_MAX:
        raise Unsupported(f"{what} = {programs}: this kernel's launch grid puts them on an axis CUDA caps at "
                          f"{GRID_AXIS_MAX}")


def heads_by_batch(heads: int, batch: int, what: str = "heads") -> tuple[int, int]:
    """A launch grid's second and third axes for one program per (sequence, head): heads, then the batch. A block's
    linear index is then the same as with batch x heads on one axis (CUDA starts blocks with the first axis
    fastest), but each axis stays under CUDA's cap alone: 4096 sequences x 32 heads run. ``what``: what the heads
    are (the decode's are kv heads)."""
    check_grid_axis(heads, what)
    check_grid_axis(batch, "sequences")
    return heads, batch


@dataclass
class Prepared:
    """What a prepare function returns: the timed call, plus the configuration it chose."""

    run: Runner
    config: dict[str, Any] = field(default_factory=dict)

    def __call__(self) -> torch.Tensor:
        return self.run()

    def with_config(self, **config: Any) -> Prepared:
        """The same call, reporting ``config`` beside its own."""
        return Prepared(self.run, config={**self.config, **config})


class PrepareFn(Protocol):
    def __call__(self, *inputs: Any, **options: Any) -> Prepared | Runner: ...


@dataclass(frozen=True)
class Impl:
    name: str
    family: str
    prepare_fn: PrepareFn
    dtypes: tuple[torch.dtype, ...] = FLOATS
    devices: tuple[str, ...] = ("cpu", "cuda")
    head_dims: tuple[int, ...] | None = None
    requires: Callable[[str], str | None] | None = None
    description: str = ""
    op: str = "dense"
    variants: tuple[str, ...] = ()  # of VARIANTS: the prepare function then takes window= / softcap=
    needs: tuple[str, ...] = ()  # optional input fields it cannot run without (backward: "lse")
    presets: tuple[str, ...] = ()  # a study rather than a contender: runs in these presets only, unless named
    forward: PrepareFn | None = None  # backward: the forward of a training step, its call returning (o, lse)

    def __repr__(self) -> str:  # short: pytest-benchmark stores it with every benchmark
        return f"Impl({self.name!r}, op={self.op!r})"

    def runs_in(self, preset: str) -> bool:
        """Whether a run that does not name this implementation runs it on ``preset``'s cases."""
        return not self.presets or preset in self.presets

    def availability(self, device: str) -> str | None:
        """``None`` when this implementation can run on ``device`` at all, else the reason it cannot."""
        device = torch.device(device).type
        if device not in self.devices:
            why = " (no CUDA device here)" if "cuda" in self.devices and not torch.cuda.is_available() else ""
            return f"runs on {' or '.join(self.devices)} only, this run is on {device}{why}"
        if device == "cuda" and not torch.cuda.is_available():
            return "no CUDA device"
        return self.requires(device) if self.requires else None

    def support_reason(self, dtype: torch.dtype, device: str, head_dim: int,
                       value_dim: int | None = None) -> str | None:
        """``None`` when the declared capabilities cover this dtype, device and head dims (v's own, if given,
        against the same declared list)."""
        reason = self.availability(device)
        if reason:
            return reason
        if dtype not in self.dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            return f"dtype {str(dtype).removeprefix('torch.')} not supported (supports {names})"
        for what, dim in (("head dim", head_dim), ("value head dim", value_dim)):
            if self.head_dims is not None and dim is not None and dim not in self.head_dims:
                return f"{what} {dim} not supported (supports {', '.join(map(str, self.head_dims))})"
        return None

    def prepare(self, *inputs: Any, causal: bool = False, scale: float | None = None,
                window: tuple[int, int] | None = None, softcap: float = 0.0) -> Prepared:
        """Validate, check support, and run the setup that stays outside any timed region.

        Dense: ``prepare(q, k, v, causal=..., scale=..., window=..., softcap=...)``; serving:
        ``prepare(inputs, scale=..., window=..., softcap=...)`` with a ``PagedKV`` or ``Varlen`` (validated when
        it was made; causality is the operation's). A window or softcap reaches only implementations that
        declare it (``variants=``); others refuse with the reason.
        """
        window, softcap = validate_variants(window, softcap)
        if self.op == "dense":
            q, k, v = inputs
            scale = validate_attention_inputs(q, k, v, scale)
            inputs = unit_head_stride(q, k, v)
            options: dict[str, Any] = {"causal": bool(causal), "scale": scale}
            value_dim = v.shape[-1]
            if value_dim != q.shape[-1] and "value_dim" not in self.variants:
                raise Unsupported(f"{self.name}: value head dim {value_dim} other than the query/key head dim "
                                  f"{q.shape[-1]} not supported")
        else:
            (batch,) = inputs
            if getattr(batch, "op", None) != self.op:
                raise TypeError(f"{self.name} runs the {self.op!r} operation, got {type(batch).__name__}")
            q, scale = batch.q, batch.scale(scale)
            inputs = (batch.in_kernel_layout(),)
            value_dim = None  # the serving operations have one head dim
            options = {"scale": scale}
            if batch.kv_fp8 and "kv_fp8" not in self.variants:
                raise Unsupported(f"{self.name}: an fp8 (e4m3) KV cache not supported")
            if getattr(batch, "packed", False) and "packed" not in self.variants:
                raise Unsupported(f"{self.name}: packed documents (cu_seqlens) not supported in {self.op}")
            missing = [name for name in self.needs if getattr(batch, name, None) is None]
            if missing:
                raise ValueError(f"{self.name} needs {', '.join(missing)} in its {self.op} inputs, got None")
        for variant, used, value in (("window", window != NO_WINDOW, window), ("softcap", softcap > 0, softcap)):
            if used and variant not in self.variants:
                raise Unsupported(f"{self.name}: {'sliding window' if variant == 'window' else 'softcap'} "
                                  f"not supported{'' if self.op == 'dense' else f' in {self.op} attention'}")
            if used:
                options[variant] = value
        reason = self.support_reason(q.dtype, q.device.type, q.shape[-1], value_dim)
        if reason:
            raise Unsupported(f"{self.name}: {reason}")
        prepared = self.prepare_fn(*inputs, **options)
        return prepared if isinstance(prepared, Prepared) else Prepared(prepared)

    def __call__(self, *inputs: Any, **options: Any) -> torch.Tensor:
        return self.prepare(*inputs, **options)()


REGISTRY: dict[tuple[str, str], Impl] = {}  # (op, name) -> implementation


def register(
    name: str,
    *,
    family: str,
    dtypes: Iterable[torch.dtype] = FLOATS,
    devices: Iterable[str] = ("cpu", "cuda"),
    head_dims: Iterable[int] | None = None,
    requires: Callable[[str], str | None] | None = None,
    description: str = "",
    op: str = "dense",
    variants: Iterable[str] = (),
    needs: Iterable[str] = (),
    presets: Iterable[str] = (),
    forward: PrepareFn | None = None,
) -> Callable[[PrepareFn], PrepareFn]:
    """Decorator: add a prepare function to the registry under ``name`` for operation ``op``."""
    if op not in OPS:
        raise ValueError(f"unknown operation {op!r}; known: {', '.join(OPS)}")
    if set(variants) - set(VARIANTS):
        raise ValueError(f"unknown variants {sorted(set(variants) - set(VARIANTS))}; known: {', '.join(VARIANTS)}")

    def decorate(fn: PrepareFn) -> PrepareFn:
        if (op, name) in REGISTRY:
            raise ValueError(f"implementation {name!r} is registered twice for {op!r}")
        REGISTRY[op, name] = Impl(
            name=name,
            family=family,
            prepare_fn=fn,
            dtypes=tuple(dtypes),
            devices=tuple(devices),
            head_dims=None if head_dims is None else tuple(head_dims),
            requires=requires,
            description=description or (fn.__doc__ or "").strip().split("\n")[0],
            op=op,
            variants=tuple(variants),
            needs=tuple(needs),
            presets=tuple(presets),
            forward=forward,
        )
        return fn

    return decorate


@contextlib.contextmanager
def refusing(*errors: type[BaseException]) -> Iterator[None]:
    """A library's refusal inside the block (one of ``errors``) becomes :class:`Unsupported` with its message;
    out of memory stays itself (the caller reports it as out of memory)."""
    try:
        yield
    except torch.OutOfMemoryError:
        raise
    except errors as exc:
        first = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise Unsupported(first) from exc


def probe(call: Runner, *errors: type[BaseException]) -> Runner:
    """Run ``call`` once; a library's refusal (one of ``errors``) becomes :class:`Unsupported`.

    For libraries that decide per input whether they can run (PyTorch's SDPA backends, flash-attn):
    the first call is also the warm-up, so nothing is lost.
    """
    with refusing(*errors):
        call()
    return call


# Autotuning buckets of a sequence length: coarse up to 1K, then every power of two up to 64K. One bucket for 1K-8K
# let the first length tuned decide for the others (H200, blog causal fp16: 128x128 leads at 2K by 6%, the persistent
# paired 128x256 at 4K by 3.5% and at 8K by 9%).
LENGTH_CLASSES = (128, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


def length_class(n: int) -> int:
    """Autotuning bucket of a sequence length: configs are tuned once per bucket, not per length."""
    return next((c for c in LENGTH_CLASSES if n <= c), LENGTH_CLASSES[-1] * 8)


def parallel_class(n: int) -> int:
    """Autotuning bucket of the independent rows of work (batch x heads): the next power of 4, up to 1024.
    How many work items a grid has against the SM count decides between tile shapes (and persistent or not)
    as much as the length does: one 16K sequence of 32 heads is not 4 x 32 heads of it."""
    bucket = 1
    while bucket < min(n, 1024):
        bucket *= 4
    return bucket


def unregister(name: str, op: str = "dense") -> None:
    REGISTRY.pop((op, name), None)


def module_available(module: str, hint: str) -> Callable[[str], str | None]:
    """A ``requires`` check: the module can be imported, else ``"<module> not installed (<hint>)"``."""

    def check(device: str) -> str | None:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        return None if found else f"{module} not installed ({hint})"

    check.__name__ = f"requires_{module.replace('.', '_')}"
    return check


DERIVED: list[Callable[[], None]] = []  # run by load_all once every module is imported


def derived(make: Callable[[], None]) -> Callable[[], None]:
    """Decorator: ``make`` registers entries built from other entries (a training step from each backward), once
    every module has registered its own, so that one in a module imported later is not missed."""
    DERIVED.append(make)
    return make


@functools.cache
def load_all() -> dict[str, Impl]:
    """Import every module of the ``impls`` package once, so that their ``@register`` lines run, then the
    ``derived`` ones."""
    import pkgutil

    import impls

    for info in sorted(pkgutil.iter_modules(impls.__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"impls.{info.name}")
    for make in DERIVED:
        make()
    return REGISTRY


def names(op: str | None = None) -> list[str]:
    """Registered names (of one operation, or of all), each once, in registration order."""
    return list(dict.fromkeys(name for o, name in REGISTRY if op in (None, o)))


def select(patterns: Iterable[str] | None = None) -> list[Impl]:
    """Registered implementations (of every operation) whose names match any glob in ``patterns``."""
    load_all()
    patterns = list(patterns or [])
    if not patterns:
        return list(REGISTRY.values())
    chosen = [impl for impl in REGISTRY.values() if any(fnmatchcase(impl.name, p) for p in patterns)]
    unmatched = [p for p in patterns if not any(fnmatchcase(name, p) for name in names())]
    if unmatched:
        raise ValueError(f"no implementation matches {', '.join(unmatched)}; known: {', '.join(names())}")
    return chosen


def get(name: str, op: str = "dense") -> Impl:
    load_all()
    try:
        return REGISTRY[op, name]
    except KeyError:
        raise KeyError(f"unknown {op} implementation {name!r}; known: {', '.join(names(op))}") from None
