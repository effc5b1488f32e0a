# vgpud: two entry points for a fresh machine (see README.md):
#   make demo   boots a Debian kernel in QEMU with nvsim + vgpu + vgpud and
#               shows the interception path working
#   make test   lint, host tests, packaging checks and the VM tier
#   make test-debug   the VM tier in a debug kernel (KASAN, lockdep, kmemleak),
#               built once from Debian's linux-source-6.1 and cached
# and one for a machine with a real NVIDIA GPU (docs/hardware.md):
#   make gpu-check   facts, recorded traces and their replay check, under out/gpu-check
.PHONY: deps modules nvtrace demo test test-host test-vm test-debug lint bench bench-probes gpu-check \
	gpu-check-wheels clean

deps:
	scripts/install-deps

modules: deps
	$(MAKE) -C kmod modules

# The LD_PRELOAD recorder of NVIDIA ioctl/mmap calls (docs/nvtrace.md).
nvtrace:
	$(MAKE) -C tools/nvtrace

demo: modules
	scripts/vm-run -- scripts/demo

test: deps
	scripts/test-all

test-host:
	.venv/bin/python -m pytest -q tests/unit

test-vm: modules
	scripts/test-vm

# Not part of `make test`: the first run builds a kernel (docs/performance.md).
test-debug: deps
	scripts/test-debug

lint:
	.venv/bin/ruff check .
	.venv/bin/mypy
	$(MAKE) -C kmod checkpatch

bench: modules
	scripts/vm-run -- python tests/bench/bench_path.py

bench-probes: modules
	scripts/vm-run -- python tests/bench/bench_probes.py

# Needs nothing but python3 and a C compiler; without a GPU it runs dry.
gpu-check:
	scripts/gpu-check

# Wheels for the GPU machine (nothing can be downloaded there), into .whl/.
gpu-check-wheels: deps
	scripts/gpu-check-wheels

clean:
	$(MAKE) -C kmod clean
	$(MAKE) -C tools/nvtrace clean
