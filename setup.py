"""Build script: pure-Python packages `macer_kernels` and `macer` (from python/macer)."""

from setuptools import find_packages, setup

packages = find_packages(include=["macer_kernels", "macer_kernels.*"])
packages += ["macer", *("macer." + p for p in find_packages("python/macer"))]

setup(packages=packages, package_dir={"macer": "python/macer"})
