"""A native float32 linear for the 1-8 rows a decode or verify step feeds (x86-64, AVX2 + FMA).

At one thread on a 2-core AMD EPYC with AVX2 (Zen 1, 2 GHz), torch's kernels for SmolLM2's
projections at few rows are far from what the CPU can do: MKL repacks the weight on every call
(a 5-row call of the MLP's 3072 x 576 projection costs 3.2x a 1-row one), and oneDNN's
prepacked kernel, the faster of the two from 2 rows on, still made a target step verifying 2
tokens cost 1.25x a 1-token step, 3 tokens 1.37x. Reading the weights, which a 1-token step
must do anyway, is the cost that should set both: `csrc/linear_avx2.c` streams each weight row
once per call, multiplies it into up to three input rows from registers and prefetches the next
rows. On that CPU the whole step (one thread, 100 tokens of context) became 1.06-1.09x for 2
tokens and 1.09-1.13x for 3, and the 1-token step itself 10-25 % faster (docs/benchmarks.md,
"Native kernels").

The source is compiled once per machine with the system C compiler (`$CC`, else `cc`, else
`gcc`) into `$LIVEDRAFT_KERNEL_DIR` (default `~/.cache/livedraft/kernels`), under a name keyed
by the source and flags, and loaded with ctypes (which releases the GIL for the call). Where it
cannot be (not x86-64, a CPU without AVX2 and FMA, no compiler, `LIVEDRAFT_NATIVE_KERNELS=0`)
`kernel()` is None and torch's kernels run; why is logged once. Whether it runs at a given row
count is measured against torch's kernels on each machine (`runtime.llama.kernel_choice`).

It is a candidate by default only where torch's own kernels are AVX2 (`default_on`): on an
AVX-512 CPU (a 2-core AMD EPYC of the Zen 5 family, measured) torch's kernels already make a
2-token step 1.07 and a 3-token step 1.10 one-token steps and the native kernel, with half their
vector width, gains nothing there (one-token step 0.97x); a candidate that cannot win only lets
calibration noise pick it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "linear_avx2.c"
FLAGS = ("-O3", "-mavx2", "-mfma", "-shared", "-fPIC")
MAX_ROWS = 8  # the kernel is built for decode and verify steps; prefill stays on torch's kernels

Kernel = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def unavailable_reason() -> str | None:
    """None when this machine can run the kernel, else why not (before any compiling)."""
    if os.environ.get("LIVEDRAFT_NATIVE_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        return "LIVEDRAFT_NATIVE_KERNELS is off"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"the CPU's vector capability is {capability}, not AVX2"
    if compiler() is None:
        return "no C compiler ($CC, cc or gcc) on PATH"
    return None


def default_on() -> bool:
    """Whether runtime.llama offers the kernel as a candidate when not told (torch at AVX2)."""
    return torch.backends.cpu.get_cpu_capability() == "AVX2"


def compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    return shutil.which("cc") or shutil.which("gcc")


def kernel_dir() -> Path:
    return Path(os.environ.get("LIVEDRAFT_KERNEL_DIR") or Path.home() / ".cache" / "livedraft" / "kernels")


def build(cc: str, out_dir: Path) -> Path:
    """Compiles the source into out_dir (once: the name is keyed by source and flags), atomically,
    so that processes building at once each see a whole library. Raises OSError or
    subprocess.CalledProcessError."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + platform.machine().encode()).hexdigest()[:16]
    lib = out_dir / f"linear_avx2-{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = out_dir / f".{lib.name}.{os.getpid()}.partial"
    try:
        subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(partial)], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(partial, lib)
    finally:
        partial.unlink(missing_ok=True)
    return lib


@functools.cache
def kernel() -> Kernel | None:
    """The native linear y = x W^T + b, or None where it is unavailable (logged once)."""
    reason = unavailable_reason()
    if reason is None:
        try:
            fn = ctypes.CDLL(str(build(compiler() or "cc", kernel_dir()))).livedraft_linear_f32
        except subprocess.CalledProcessError as e:
            reason = f"compiling {SOURCE.name} failed: {(e.stderr or '').strip()[-500:]}"
        except (OSError, subprocess.SubprocessError) as e:
            reason = f"building or loading {SOURCE.name} failed: {e}"
    if reason is not None:
        log.info("native linear kernel not used: %s", reason)
        return None
    ptr, size = ctypes.c_void_p, ctypes.c_long
    fn.argtypes = [ptr, ptr, ptr, ptr, size, size, size]
    fn.restype = None

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        n, k = weight.shape
        flat = x.reshape(-1, k)
        if flat.dtype != torch.float32 or weight.dtype != torch.float32 or not weight.is_contiguous():
            raise ValueError("the native linear takes float32 input and a contiguous float32 weight")
        flat = flat.contiguous()
        rows = flat.shape[0]
        y = torch.empty(rows, n, dtype=torch.float32)
        if rows:
            fn(flat.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
               rows, k, n)
        return y.view(*x.shape[:-1], n)

    return linear


def usable(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the native kernel can compute with this weight (and bias) at all."""
    ok = weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2 and weight.is_contiguous()
    if bias is not None:
        ok = ok and bias.device.type == "cpu" and bias.dtype == torch.float32 and bias.is_contiguous()
    return ok and kernel() is not None
