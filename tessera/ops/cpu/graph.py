"""Kernel graphs: the C kernel calls of one forward pass, recorded and replayed from C.

The CPU analogue of a CUDA graph. A decode step of the default model makes ~300 kernel
calls, and the Python around them (layers, builders, ctypes) costs 3-4 ms of a 12 ms step;
replaying the recorded calls (same functions, same pointers, same sizes) costs
microseconds. `capture()` runs a forward pass normally while recording every `Kernel`
call; `KernelGraph.replay()` then repeats them, reading whatever the input buffers the
pass read now hold.

A replay is right only if the pass was kernels alone and every recorded pointer stays
valid. So, during capture, a torch dispatch guard watches every tensor op: views and empty
allocations are fine (their memory is held by the graph, so nothing else reuses it); any
op that computes or writes (a replay would skip it) makes the graph unusable, and
`KernelGraph.refused` says which. What the guard cannot see is Python deciding from data
it reads without a torch op (`.tolist()`, host-side lists, thread counts): kernel builders
must pass such values as kernel arguments or take the same path for every step a graph
serves. Memory the pass only reads (weights, KV cache, input buffers) is the owner's to
keep: it captures again after replacing any of it.
"""
from __future__ import annotations

import ctypes
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tessera.ops.cpu import build
from tessera.ops.cpu.build import Kernel

# ops that only allocate: their (uninitialised) output is filled by kernels
_ALLOCATIONS = {torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.new_empty,
                torch.ops.aten.empty_strided, torch.ops.aten.new_empty_strided}
# ctypes argument and result types -> C spelling; a replay passes every argument as int64 bits
_C_TYPES = {ctypes.c_void_p: "void *", ctypes.c_int64: "int64_t", ctypes.c_int: "int",
            ctypes.c_float: "float", ctypes.c_double: "double"}


class ReplayError(RuntimeError):
    pass


def _signature(kernel: Kernel) -> tuple:
    return (kernel.restype, *kernel.argtypes)


def _encode(kernel: Kernel, args: tuple) -> list[int]:
    """Each argument as the int64 the replayer passes (floats as their bits)."""
    if len(args) != len(kernel.argtypes):
        raise TypeError(f"{kernel.symbol} takes {len(kernel.argtypes)} arguments, got {len(args)}")
    out = []
    for kind, value in zip(kernel.argtypes, args):
        if kind is ctypes.c_float:  # through ctypes, as a direct call converts (inf past FLT_MAX)
            out.append(ctypes.c_int32.from_buffer(ctypes.c_float(value)).value)
        elif kind is ctypes.c_double:
            out.append(ctypes.c_int64.from_buffer(ctypes.c_double(value)).value)
        else:
            out.append(int(value or 0))
    return out


def _replayer_source(signatures: list[tuple]) -> str:
    """C for `tessera_graph_replay`: calls i runs fns[i] through the cast of its signature
    kinds[i], stopping at the first nonzero status."""
    for sig in signatures:
        unknown = [t for t in sig if t is not None and t not in _C_TYPES]
        if unknown:
            raise TypeError(f"no C spelling for ctypes type(s) {unknown}")
    cases = []
    for i, (restype, *argtypes) in enumerate(signatures):
        params = ", ".join(_C_TYPES[t] for t in argtypes) or "void"
        values = []
        for j, t in enumerate(argtypes):
            values.append({ctypes.c_void_p: f"(void *)(intptr_t)a[{j}]", ctypes.c_float: f"as_float(a[{j}])",
                           ctypes.c_double: f"as_double(a[{j}])", ctypes.c_int: f"(int)a[{j}]"}.get(t, f"a[{j}]"))
        call = f"(({'void' if restype is None else _C_TYPES[restype]} (*)({params}))fns[i])({', '.join(values)})"
        cases.append(f"        case {i}: {call + ';' if restype is None else f'status = (int64_t){call};'} break;")
    return "\n".join([
        "#include <stdint.h>",
        "#include <string.h>",
        "static inline float as_float(int64_t v) { int32_t b = (int32_t)v; float f; memcpy(&f, &b, 4); return f; }",
        "static inline double as_double(int64_t v) { double f; memcpy(&f, &v, 8); return f; }",
        "int64_t tessera_graph_replay(int64_t n, const int32_t *kinds, void *const *fns,",
        "                             const int64_t *offsets, const int64_t *args, int64_t *failed) {",
        "    for (int64_t i = 0; i < n; i++) {",
        "        const int64_t *a = args + offsets[i];",
        "        int64_t status = 0;",
        "        switch (kinds[i]) {",
        *cases,
        "        default: status = -1;",
        "        }",
        "        if (status) { *failed = i; return status; }",
        "    }",
        "    return 0;",
        "}",
        "",
    ])


@dataclass(eq=False)  # identity: recorders are found and removed by identity
class KernelGraph:
    """The kernel calls of one captured pass, and the tensors it created."""

    calls: list[tuple[Kernel, list[int]]] = field(default_factory=list)
    keep: list[torch.Tensor] = field(default_factory=list, repr=False)
    refused: list[str] = field(default_factory=list)  # ops a replay could not repeat
    # storage -> bytes of what the pass allocated (its views of weights are kept, not counted)
    allocated: dict[int, int] = field(default_factory=dict, repr=False)
    thread: int = field(default_factory=threading.get_ident)  # the capturing thread
    _bound: tuple | None = field(default=None, repr=False)

    def record(self, kernel: Kernel, args: tuple) -> None:
        self.calls.append((kernel, _encode(kernel, args)))

    @property
    def replayable(self) -> bool:
        return not self.refused

    @property
    def held_bytes(self) -> int:
        """Memory the capture allocated (held as long as the graph)."""
        return sum(self.allocated.values())

    def _bind(self) -> tuple:
        signatures = sorted({_signature(k) for k, _ in self.calls}, key=repr)
        index = {sig: i for i, sig in enumerate(signatures)}
        # a loop of indirect calls: no vector ISA needed, so it builds for any CPU
        lib = build.load_source("graph_replay", _replayer_source(signatures), flags=build.BASE_FLAGS)
        fn = lib.tessera_graph_replay
        fn.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 5
        fn.restype = ctypes.c_int64
        n = len(self.calls)
        offsets, flat = [], []
        for _, args in self.calls:
            offsets.append(len(flat))
            flat.extend(args)
        kinds = (ctypes.c_int32 * n)(*(index[_signature(k)] for k, _ in self.calls))
        fns = (ctypes.c_void_p * n)(*(k.address for k, _ in self.calls))
        offs = (ctypes.c_int64 * n)(*offsets)
        values = (ctypes.c_int64 * max(1, len(flat)))(*flat)
        failed = ctypes.c_int64(0)
        args = (n, ctypes.addressof(kinds), ctypes.addressof(fns), ctypes.addressof(offs),
                ctypes.addressof(values), ctypes.addressof(failed))
        return fn, args, failed, (kinds, fns, offs, values)

    def prepare(self) -> None:
        """Build and bind the replayer (a C compile the first time a set of kernel
        signatures is seen); KernelBuildError if that fails. replay() calls it if needed."""
        if self.refused:
            raise ReplayError(f"this pass ran ops a replay cannot repeat: {', '.join(self.refused)}")
        if self._bound is None:
            self._bound = self._bind()

    def replay(self) -> None:
        """Run the recorded calls again; ReplayError names a kernel that returned failure."""
        self.prepare()
        fn, args, failed, _ = self._bound
        status = fn(*args)
        if status:
            kernel = self.calls[failed.value][0]
            raise ReplayError(f"{kernel.symbol} (call {failed.value} of {len(self.calls)}) "
                              f"failed with status {status}")


class _Guard(TorchDispatchMode):
    """Holds every tensor the pass creates; notes every op that is not a view or an
    allocation (a replay runs kernels only)."""

    def __init__(self, graph: KernelGraph):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if func.overloadpacket in _ALLOCATIONS:
            for t in outputs:
                self.graph.allocated[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        else:
            inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor)}
            aliases = outputs and all(t.untyped_storage().data_ptr() in inputs for t in outputs)
            if func._schema.is_mutable or not aliases:
                self.graph.refused.append(str(func))
        self.graph.keep.extend(outputs)
        return out


@contextmanager
def capture() -> Iterator[KernelGraph]:
    """Record the kernel calls this thread makes inside the block (which run as usual);
    other threads' calls and torch ops (the dispatch mode is per thread) are not seen."""
    graph = KernelGraph()
    build._recorders.append(graph)
    try:
        with _Guard(graph):
            yield graph
    finally:
        build._recorders.remove(graph)
