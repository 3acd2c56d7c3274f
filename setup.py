"""The optional compiled CPU reductions; the rest of the build is declared in pyproject.toml.

``torchinstruments_core.reducers._kernels`` is optional: where no C compiler is found, or the
build fails, the package installs without it and reduces with numpy and torch instead
(``reducers/_native.py``), with the same results up to the rounding of sums.
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# Fused multiply-adds would change the histogram's float operations, which must match the
# device path bit for bit (``reducers/_binning.py``); errno is never read.
_FLAGS = {
    "msvc": ["/O2", "/fp:precise"],
    "unix": ["-O3", "-ffp-contract=off", "-fno-math-errno"],
}


class _BuildExt(build_ext):
    """``build_ext`` with the flags of the compiler found."""

    def build_extensions(self) -> None:
        flags = _FLAGS.get(self.compiler.compiler_type, _FLAGS["unix"])
        for extension in self.extensions:
            extension.extra_compile_args = flags
        super().build_extensions()


setup(
    ext_modules=[
        Extension(
            "torchinstruments_core.reducers._kernels",
            ["src/torchinstruments_core/reducers/_kernels.c"],
            py_limited_api=True,
            define_macros=[("Py_LIMITED_API", "0x030B0000")],
            optional=True,
        )
    ],
    cmdclass={"build_ext": _BuildExt},
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
