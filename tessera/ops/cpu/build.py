"""Compile a C kernel of this folder once and load it with ctypes.

The shared library is cached under the tessera cache folder by a hash of its source and
flags, built into a temporary file and renamed into place (tensor-parallel ranks may build
at the same time). A plain C file compiles in about a second, where a torch C++ extension
would take most of a minute of header parsing; the kernels take raw pointers, so ctypes
(which releases the GIL during the call) is all the binding they need.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
CACHE = Path.home() / ".cache" / "tessera" / "kernels"
BASE_FLAGS = ("-O3", "-shared", "-fPIC", "-fopenmp")
# Kernel families. AVX512 (the default): what its flags let the compiler use, a CPU must
# have. AVX2 (*_avx2.c files) for CPUs without AVX512. Portable (PORTABLE_SOURCES: byte
# copies, the quantizers, the MoE layer driver: plain C) for any CPU.
AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma")
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "fma")
AVX2_FLAGS = ("-mavx2", "-mfma")
AVX2_CPU_FLAGS = ("avx2", "fma")
PORTABLE_SOURCES = ("kv_write.c", "kv_write_fp8.c", "embedding.c", "quantize_groups.c", "moe_layer.c")
# AMX (*_amx.c files: Sapphire Rapids and later Xeons): the AVX512 family's flags, its bf16
# extension and AMX's tiles, all of which the CPU must have.
AMX_FLAGS = ("-mavx512bf16", "-mamx-tile", "-mamx-bf16")
AMX_CPU_FLAGS = ("avx512_bf16", "amx_tile", "amx_bf16")
# Extensions the AVX512 kernels use when the CPU has them and emulate otherwise (simd_bf16.h):
# /proc/cpuinfo flag -> compiler flag. Many AVX512 CPUs lack AVX512-BF16 (Skylake-X to Ice
# Lake, and hypervisors that hide it); their kernels widen bf16 to float32 in registers.
OPTIONAL_EXTENSIONS = {"avx512_bf16": "-mavx512bf16", "avx512_vnni": "-mavx512vnni"}
# TESSERA_CPU_KERNEL_ISA narrows what is used, so tests can run every build on one machine:
# `avx512` builds the AVX512 kernels without the extensions, `avx2` takes the AVX512 family
# away (as on a CPU without it); the default `native` uses what the CPU has.
ISA_ENV = "TESSERA_CPU_KERNEL_ISA"


class KernelBuildError(RuntimeError):
    pass


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str] | None:
    """The flags /proc/cpuinfo lists (None where it cannot be read)."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return None


ISA_SETTINGS = ("native", "avx512", "avx2")


def _isa_setting() -> str:
    # read on each call, but built and bound kernels are cached per process: set it before
    # the first kernel loads (tests run the other builds in subprocesses)
    value = os.environ.get(ISA_ENV, "native")
    if value not in ISA_SETTINGS:
        raise ValueError(f"{ISA_ENV}={value!r}: expected one of {', '.join(ISA_SETTINGS)}")
    return value


AMX_DEFINE = "TESSERA_AMX 1"  # an AVX512 source built for AMX (widened_gemm.h's AMX build)


def kernel_family(source_name: str, defines: tuple[str, ...] = ()) -> str:
    """"avx512", "avx2", "amx" or "portable": which flags build the kernel in `source_name`
    (with `defines`)."""
    if source_name.endswith("_amx.c") or AMX_DEFINE in defines:  # (an AVX2 source too: AMX implies it)
        return "amx"
    if source_name.endswith("_avx2.c"):
        return "avx2"
    return "portable" if source_name in PORTABLE_SOURCES else "avx512"


def missing_cpu_flags(source_name: str = "", defines: tuple[str, ...] = ()) -> list[str]:
    """What the kernel in `source_name` needs that this CPU lacks (AVX512 family by default)."""
    family = kernel_family(source_name, defines)
    if family == "portable":
        return []
    required = AVX2_CPU_FLAGS if family == "avx2" else REQUIRED_CPU_FLAGS
    if family == "amx":
        required = REQUIRED_CPU_FLAGS + AMX_CPU_FLAGS
    flags = cpu_flags()
    if flags is None:
        return list(required)
    missing = [f for f in required if f not in flags]
    if not missing and family in ("avx512", "amx") and _isa_setting() == "avx2":
        return [f"AVX512 ({ISA_ENV}=avx2)"]
    if not missing and family == "amx" and _isa_setting() != "native":
        return [f"AMX ({ISA_ENV}={_isa_setting()})"]
    return missing


def extensions_used() -> tuple[str, ...]:
    """The optional extensions (cpuinfo names) the AVX512 kernels are built for on this CPU."""
    if _isa_setting() != "native":
        return ()
    flags = cpu_flags() or frozenset()
    return tuple(ext for ext in OPTIONAL_EXTENSIONS if ext in flags)


def f16c_missing() -> list[str]:
    """The fp8 KV cache kernels and the int8 / int4 GEMMs' AVX2 builds widen float16s through
    F16C (enabled for those builds alone): why they cannot run here, if the CPU lacks it."""
    flags = cpu_flags()
    return [] if flags is None or "f16c" in flags else ["this CPU lacks f16c (float16 widening)"]


def unavailable_with_f16c(kernel: "Kernel", spec: object = None) -> list[str]:
    """Why neither build of `kernel` can run here, where its AVX2 build widens float16 scales
    with F16C (the int8 and int4 GEMMs)."""
    reasons = kernel.check(spec)
    if not reasons and kernel.runnable_source() == kernel.fallback_source:
        return f16c_missing()
    return reasons


def build_flags(source_name: str = "", defines: tuple[str, ...] = ()) -> tuple[str, ...]:
    family = kernel_family(source_name, defines)
    if family == "portable":
        return BASE_FLAGS
    if family == "avx2":
        return BASE_FLAGS + AVX2_FLAGS
    extensions = tuple(OPTIONAL_EXTENSIONS[ext] for ext in extensions_used())
    if family == "amx":  # (the extensions too: an AMX build's other paths are the AVX512 build's)
        return BASE_FLAGS + AVX512_FLAGS + extensions + tuple(f for f in AMX_FLAGS if f not in extensions)
    return BASE_FLAGS + AVX512_FLAGS + extensions


def isa_description() -> str:
    """One line for logs and `tessera inspect`: what the kernels compute with here."""
    if missing_cpu_flags():
        if missing_cpu_flags("gemm_bf16_avx2.c"):
            return "none (no AVX512 or AVX2)"
        return ("AVX2 builds (no AVX512): bf16 widened to float32; int8 and int4 weights via vpmaddwd "
                "(int4's decode batches on 8-bit x via vpmaddubsw)")
    used = extensions_used()
    bf16 = "native bf16 dot products (avx512_bf16)" if "avx512_bf16" in used else \
        "bf16 widened to float32 in registers, no avx512_bf16"
    int8 = "vpdpwssd (decode batches on 8-bit x via vpdpbusd)" if "avx512_vnni" in used else \
        "vpmaddwd, no avx512_vnni (int4's decode batches on 8-bit x via vpmaddubsw)"
    return f"{bf16}; int8 and int4 weights via {int8}"


def unavailable_reason(source_name: str, defines: tuple[str, ...] = ()) -> str | None:
    """Why the kernel in `source_name` (built with `defines`) cannot run here (no ISA, no
    compiler, a failed build), or None: what a registry builder's `check` reports."""
    missing = missing_cpu_flags(source_name, defines)
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    try:
        load_kernel(source_name, defines=defines)
    except (KernelBuildError, OSError) as exc:
        return f"kernel unavailable: {exc}"
    return None


def compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


@lru_cache(maxsize=None)
def load_kernel(source_name: str, cache_dir: Path = CACHE, defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Build (once) and load tessera/ops/cpu/<source_name>, with `defines` ("NAME VALUE")
    ahead of its text (one source, several variants); KernelBuildError says why not."""
    source = HERE / source_name
    text = "".join(f"#define {d}\n" for d in defines) + source.read_text()
    stem = "-".join((source.stem, *(d.replace(" ", "") for d in defines)))
    return load_source(stem, text, cache_dir, build_flags(source_name, defines))


def load_source(stem: str, text: str, cache_dir: Path = CACHE,
                flags: tuple[str, ...] | None = None) -> ctypes.CDLL:
    """Build (once per distinct text and flags) and load C source `text`, which may include
    this folder's headers; the library is cached as <stem>-<hash>.so. `flags`: the AVX512
    family's by default."""
    cc = compiler()
    if cc is None:
        raise KernelBuildError("no C compiler (cc or gcc) on PATH")
    flags = build_flags() if flags is None else flags
    headers = b"".join(h.read_bytes() for h in sorted(HERE.glob("*.h")))
    digest = hashlib.sha256(text.encode() + headers + " ".join(flags).encode()).hexdigest()[:16]
    target = cache_dir / f"{stem}-{digest}.so"
    if not target.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
        os.close(fd)
        # from this folder: for a source read from stdin, quoted includes are searched in
        # the working directory first, and a stray bf16.h there must not shadow ours
        result = subprocess.run([cc, *flags, f"-I{HERE}", "-x", "c", "-", "-o", tmp],
                                input=text, capture_output=True, text=True, cwd=HERE)
        if result.returncode != 0:
            os.unlink(tmp)
            raise KernelBuildError(f"{cc} failed on {stem}: {result.stderr.strip()[-500:]}")
        os.replace(tmp, target)
        logger.info("built %s", target)
    return ctypes.CDLL(str(target))


# Kernel calls go to the innermost active recorder of the calling thread as well
# (tessera/ops/cpu/graph.py captures a decode step's calls to replay them without Python).
_recorders: list = []


@dataclass(frozen=True)
class Kernel:
    """One C function of one kernel file, typed for ctypes and built on its first call.
    `check` is the registry check of every builder that runs it."""

    source: str
    symbol: str
    argtypes: tuple
    restype: Any = None
    # the same symbol built for CPUs that `source` cannot run on (an *_avx2.c file)
    fallback_source: str | None = None
    # "NAME VALUE" macros defined ahead of the source (a variant of a shared source)
    defines: tuple[str, ...] = ()

    def __call__(self, *args):
        if _recorders:
            for recorder in reversed(_recorders):
                if recorder.thread == threading.get_ident():
                    recorder.record(self, args)
                    break
        return self._fn(*args)

    @cached_property
    def _fn(self):  # bound once per Kernel object (no per-call hashing of the dataclass)
        return _bind(self)

    @cached_property
    def address(self) -> int:
        """The C function's address (built and bound on first use): what a kernel graph's
        replayer, or a kernel taking another as a function pointer, calls."""
        return ctypes.cast(self._fn, ctypes.c_void_p).value

    def runnable_source(self) -> str:
        """`source`, or `fallback_source` where only that one can run here."""
        if (self.fallback_source and unavailable_reason(self.source, self.defines)
                and not unavailable_reason(self.fallback_source, self.defines)):
            return self.fallback_source
        return self.source

    def check(self, spec: object) -> list[str]:
        reason = unavailable_reason(self.source, self.defines)
        if reason and self.fallback_source:
            fallback = unavailable_reason(self.fallback_source, self.defines)
            if fallback is None:
                return []
            reason = f"{reason}; {self.fallback_source}: {fallback}"
        return [reason] if reason else []


@lru_cache(maxsize=None)
def _bind(kernel: Kernel):
    fn = getattr(load_kernel(kernel.runnable_source(), defines=kernel.defines), kernel.symbol)
    fn.argtypes = list(kernel.argtypes)
    fn.restype = kernel.restype
    return fn
