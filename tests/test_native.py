"""The native float32 linear (runtime/native.py): exact enough against F.linear at every shape it
meets, the same bits for a row whatever the row count, built once and atomically, and absent
with a reason where it cannot run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from runtime import native

needs_kernel = pytest.mark.skipif(native.kernel() is None, reason=f"no native kernel: {native.unavailable_reason()}")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8])
@pytest.mark.parametrize(("n", "k"), [(40, 24), (7, 19), (4, 8), (1, 1), (131, 576), (9, 1536)])
@pytest.mark.parametrize("bias", [True, False])
def test_native_linear_equals_f_linear(rows, n, k, bias):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    torch.testing.assert_close(native.kernel()(x, w, b), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_a_rows_result_does_not_depend_on_how_many_rows_share_the_call():
    """A verify step of k + 1 rows and a one-token step give each row the same bits: the speculative
    path and the target alone then disagree on no near-tie through these projections."""
    w, b, x = torch.randn(97, 200), torch.randn(97), torch.randn(8, 200)
    full = native.kernel()(x, w, b)
    for rows in range(1, 9):
        assert torch.equal(native.kernel()(x[:rows], w, b), full[:rows])
    assert torch.equal(native.kernel()(x[5:6], w, b), full[5:6])


@needs_kernel
def test_native_linear_keeps_leading_dims_reads_strided_input_and_takes_no_rows():
    w = torch.randn(16, 24)
    x = torch.randn(2, 3, 48)[..., ::2]  # not contiguous
    got = native.kernel()(x, w, None)
    assert got.shape == (2, 3, 16)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-4)
    assert native.kernel()(torch.empty(0, 24), w, None).shape == (0, 16)
    with pytest.raises(ValueError, match="float32"):
        native.kernel()(x.double(), w, None)
    assert not native.usable(w.t(), None) and not native.usable(w.double(), None)


def test_build_is_cached_by_source_and_atomic(tmp_path):
    cc = native.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    lib = native.build(cc, tmp_path)
    assert lib.exists() and lib.name.startswith("linear_avx2-")
    mtime = lib.stat().st_mtime_ns
    assert native.build(cc, tmp_path) == lib and lib.stat().st_mtime_ns == mtime  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [lib.name]  # no partial file left


def test_a_failing_compiler_raises_and_leaves_nothing(tmp_path):
    bad = tmp_path / "cc"
    bad.write_text("#!/bin/sh\necho 'cc: fatal error: no' >&2\nexit 1\n")
    bad.chmod(0o755)
    with pytest.raises(subprocess.CalledProcessError):
        native.build(str(bad), tmp_path / "out")
    assert not any((tmp_path / "out").iterdir())


def test_switched_off_or_without_a_compiler_there_is_no_kernel_and_runners_still_run(tmp_path):
    """In a fresh process: LIVEDRAFT_NATIVE_KERNELS=0, then an empty PATH and no $CC; both give a
    reason, no kernel, and a Linear that computes with torch's kernels only."""
    code = (
        "import torch; from runtime import native; from runtime.llama import Linear\n"
        "print(native.unavailable_reason()); assert native.kernel() is None\n"
        "w, x = torch.randn(8, 16), torch.randn(3, 16); lin = Linear(w)\n"
        "assert 'native' not in lin._choice; torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, w))\n"
    )
    for env, unset in (({"LIVEDRAFT_NATIVE_KERNELS": "0"}, ()), ({"PATH": str(tmp_path)}, ("CC",))):
        full = {**os.environ, "LIVEDRAFT_KERNEL_DIR": str(tmp_path / "k"), **env}
        for name in unset:
            full.pop(name, None)
        out = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert ("off" in out.stdout) if "LIVEDRAFT_NATIVE_KERNELS" in env else ("compiler" in out.stdout)


@needs_kernel
@pytest.mark.parametrize(("capability", "offered"), [("AVX2", True), ("AVX512", False), ("DEFAULT", False)])
def test_the_kernel_is_a_default_candidate_only_where_torch_runs_avx2(monkeypatch, capability, offered):
    """On AVX-512 torch's own kernels are already near the weight-read cost (docs/benchmarks.md,
    "Native kernels"): the native kernel is offered there only when asked for."""
    from runtime.llama import Linear

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    w = torch.randn(8, 16)
    assert native.default_on() is offered
    assert (Linear(w)._native is not None) is offered
    assert Linear(w, native_kernel=True)._native is not None
    assert Linear(w, native_kernel=False)._native is None
