# vgpud: two entry points for a fresh machine (see README.md):
#   make demo   boots a Debian kernel in QEMU with nvsim + vgpu + vgpud and
#               shows the interception path working
#   make test   lint, host tests, packaging checks and the VM tier
.PHONY: deps modules demo test test-host test-vm lint bench clean

deps:
	scripts/install-deps

modules: deps
	$(MAKE) -C kmod modules

demo: modules
	scripts/vm-run -- scripts/demo

test: deps
	scripts/test-all

test-host:
	.venv/bin/python -m pytest -q tests/unit

test-vm: modules
	scripts/test-vm

lint:
	.venv/bin/ruff check .
	.venv/bin/mypy
	$(MAKE) -C kmod checkpatch

bench: modules
	scripts/vm-run -- python tests/bench/bench_path.py

clean:
	$(MAKE) -C kmod clean
