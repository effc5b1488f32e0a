"""vgpud's tests: tests/unit (host tier), tests/vm (VM tier), tests/bench (figures),
and tests/support, the helpers they share (imported as ``tests.support.*``)."""
