"""The one C extension, beside pyproject.toml (which holds everything else): RandomResizedCrop's crop decoder.

Optional: without a compiler or libjpeg headers the package still installs and the crop decodes with
Pillow (`feedline doctor` says which). ./scripts/setup requires it; the image builds it.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("feedline.formats._jpegcrop", ["app/formats/_jpegcrop.c", "app/formats/_resample.c"],
                             depends=["app/formats/_resample.h"], libraries=["jpeg"],
                             extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
                             optional=True)])
