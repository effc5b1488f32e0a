/* SPDX-License-Identifier: GPL-2.0 */
/*
 * What the hostile tenants of tests/vm/hostile share: the escapes and the
 * params they call with, a clock, fault recovery for a thread that touches
 * pages that may go away under it, and the search for the module's shadow
 * of a call's params among the tenant's own mappings.
 */
#ifndef VGPU_TESTS_ATTACK_H
#define VGPU_TESTS_ATTACK_H

#include <setjmp.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#define NV_IOCTL_MAGIC		'F'
#define NV_ESC_RM_FREE		0x29
#define NV_ESC_RM_CONTROL	0x2A
#define NV_ESC_RM_ALLOC		0x2B
#define NV_ESC_RM_VID_HEAP	0x4A
#define NV_ESC_RM_MAP_MEMORY	0x4E
#define NV_ESC_REGISTER_FD	201
#define NV_ESC_IOCTL_XFER_CMD	211

/* NVOS00: RM_FREE. */
struct nvos00 {
	uint32_t h_root, h_parent, h_object, status;
};

/* NVOS21: RM_ALLOC. */
struct nvos21 {
	uint32_t h_root, h_parent, h_new, h_class;
	uint64_t p_alloc_parms;
	uint32_t params_size, status;
};

/* NVOS54: RM_CONTROL. */
struct nvos54 {
	uint32_t h_client, h_object, cmd, flags;
	uint64_t params;
	uint32_t params_size, status;
};

_Static_assert(sizeof(struct nvos00) == 16, "NVOS00 is 16 bytes");
_Static_assert(sizeof(struct nvos21) == 32, "NVOS21 is 32 bytes");
_Static_assert(sizeof(struct nvos54) == 32, "NVOS54 is 32 bytes");

static inline double now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

/*
 * A thread that reads or writes pages which may be unmapped under it (a
 * shadow lives for one call) sets @armed and a sigsetjmp(lost) to come back
 * to: a SIGSEGV or SIGBUS there returns to it. Anywhere else it kills.
 */
static __thread sigjmp_buf lost;
static __thread volatile sig_atomic_t armed;

static inline void on_fault(int sig)
{
	if (!armed) {
		signal(sig, SIG_DFL);
		raise(sig);
		return;
	}
	siglongjmp(lost, 1);
}

static inline void catch_faults(void)
{
	signal(SIGSEGV, on_fault);
	signal(SIGBUS, on_fault);
}

/* Largest mapping searched for the shadow (its params at a page start). */
#define SHADOW_MAX_SCAN		(64UL << 20)
#define SHADOW_MAX		8

/* Pages found that begin as the tenant's params do, and their mappings. */
struct shadows {
	char *page[SHADOW_MAX];
	unsigned long lo[SHADOW_MAX], hi[SHADOW_MAX];
	atomic_int n;
	atomic_ulong found;	/* pages found, all told */
};

/*
 * Adds to @s the pages of the tenant's readable and writable mappings, but
 * the kernel's ([stack], [vvar]...), whose first words @match and that are
 * not yet known; with @name, only in mappings so named. The tenant's own
 * params are on its stack, so what is found is the module's.
 */
static inline void find_shadows(struct shadows *s, int (*match)(volatile uint32_t *p),
				const char *name)
{
	char line[512];
	FILE *f = fopen("/proc/self/maps", "r");
	int n = atomic_load(&s->n);

	if (!f)
		return;
	while (n < SHADOW_MAX && fgets(line, sizeof(line), f)) {
		unsigned long lo, hi, off;
		char perms[8];
		int i, known, end = 0;

		if (sscanf(line, "%lx-%lx %7s %*s %*s %*s %n", &lo, &hi, perms, &end) < 3)
			continue;
		if (hi - lo > SHADOW_MAX_SCAN || perms[0] != 'r' || perms[1] != 'w' ||
		    line[end] == '[' || (name && !strstr(line + end, name)))
			continue;
		for (off = lo; off < hi && n < SHADOW_MAX; off += 4096) {
			if (!match((volatile uint32_t *)off))
				continue;
			known = 0;
			for (i = 0; i < n; i++)
				known |= s->page[i] == (char *)off;
			if (!known) {
				s->lo[n] = lo;
				s->hi[n] = hi;
				s->page[n++] = (char *)off;
				atomic_fetch_add(&s->found, 1);
			}
		}
	}
	fclose(f);
	atomic_store(&s->n, n);
}

#endif /* VGPU_TESTS_ATTACK_H */
