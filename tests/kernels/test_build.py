"""Where the kernels' libraries live, and ``duoserve build-kernels``, the install's step that
builds them so a first start (even with an empty home) compiles nothing."""

from __future__ import annotations

from duoserve.cli import main
from duoserve.kernels import build


def test_the_kernel_directory_is_beside_the_package_unless_named(monkeypatch, tmp_path):
    monkeypatch.delenv("DUOSERVE_KERNEL_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "empty-home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-home" / ".cache"))
    assert build.kernel_dir() == build.PACKAGE_KERNEL_DIR, "an editable install is writable: no home needed"
    # a system install the user cannot write (faked: CI may run as root, who writes anywhere)
    monkeypatch.setattr(build.os, "access", lambda path, mode: not str(path).startswith(str(build.CSRC.parent)))
    assert build.kernel_dir() == tmp_path / "empty-home" / ".cache" / "duoserve" / "kernels"
    monkeypatch.setenv("DUOSERVE_KERNEL_DIR", str(tmp_path / "named"))
    assert build.kernel_dir() == tmp_path / "named"


def test_a_library_built_for_another_cpu_is_not_found(monkeypatch, tmp_path):
    """-march=native builds for the CPU at hand; the CPU's flags are in the tag, so after the
    machine changes under a kept library the next start builds a new one instead of loading it."""
    monkeypatch.setenv("DUOSERVE_KERNEL_DIR", str(tmp_path))
    built = []

    def stages(tmp, out):
        built.append(out.name)
        return [[["cp", str(build.CSRC / "glue.h"), str(out)]]]

    sources = [build.CSRC / "glue.c"]
    first = build._cached_build("probe", sources, "salt", stages)
    assert build._cached_build("probe", sources, "salt", stages) == first and len(built) == 1, "found, not rebuilt"
    monkeypatch.setattr(build, "cpu_identity", lambda: "model name : another CPU\nflags : sse2 avx2")
    other = build._cached_build("probe", sources, "salt", stages)
    assert other != first and len(built) == 2 and other.parent == first.parent == tmp_path


def test_the_cpu_identity_has_the_instruction_sets():
    identity = build.cpu_identity()
    assert "avx2" in identity or "sse2" in identity, identity[:300]


def test_build_kernels_names_the_library_or_says_why_not(monkeypatch, capsys):
    assert main(["build-kernels"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("the C kernels of this machine are in ") and str(build.kernel_dir()) in out
    assert build.op_library().exists()
    monkeypatch.setenv("DUOSERVE_C_KERNELS", "0")
    assert main(["build-kernels"]) == 0, "the README's install goes on to serve, on the torch paths"
    assert "DUOSERVE_C_KERNELS=0: nothing to build" in capsys.readouterr().err
