"""Root of the test tree.

``tests`` is a package, so pytest imports this file as ``tests.conftest`` with
the repository root on sys.path: every test module can then import the shared
helpers as ``tests.support.*``, whichever way pytest was started.
"""
