"""Development tools of the checkout, never installed (pyproject.toml ships
``vgpud*`` only): run from the repository root, e.g. ``python -m tools.nvtrace``.

A regular package (not a namespace one), so that this checkout's ``tools`` is
the one imported, whatever else is on sys.path.

nvtrace/: the LD_PRELOAD recorder of NVIDIA driver calls (C) and the replay
check of its traces through vgpud (Python); docs/nvtrace.md.
"""
