// SPDX-License-Identifier: GPL-2.0
/*
 * A hostile tenant flooding the daemon with upcalls (tests/vm/hostile).
 *
 *   attack_flood NODE PROCS THREADS SECONDS
 *
 * PROCS processes (the caller and PROCS - 1 forks), each with THREADS
 * threads; every thread opens NODE for itself (a context of its own, and an
 * OPEN upcall) and then, for SECONDS, alternates two upcalled calls on
 * handles that do not exist: RM_FREE (NVOS00, a POST event after it) and
 * RM_CONTROL FB_GET_INFO_V2 with a 16 KiB params block, which the upcall
 * carries whole (the largest upcall a tenant can make). Prints
 * "calls N ok N hostdown N timedout N intr N other N opens N procs P
 * threads T" once all have stopped: ok counts calls that returned 0 (the
 * driver's status says the handles are bad), hostdown and timedout the
 * calls the module failed for want of a verdict.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "attack.h"

#define FB_GET_INFO_V2		0x20801303u
#define BIG			16384

struct totals {
	atomic_ulong calls, ok, hostdown, timedout, intr, other, opens;
};

static struct totals *tot;
static const char *node;
static double deadline;

static void count(int ret)
{
	atomic_fetch_add(&tot->calls, 1);
	if (!ret)
		atomic_fetch_add(&tot->ok, 1);
	else if (errno == EHOSTDOWN)
		atomic_fetch_add(&tot->hostdown, 1);
	else if (errno == ETIMEDOUT)
		atomic_fetch_add(&tot->timedout, 1);
	else if (errno == EINTR)
		atomic_fetch_add(&tot->intr, 1);
	else
		atomic_fetch_add(&tot->other, 1);
}

static void *flood(void *arg)
{
	static __thread unsigned char big[BIG];
	struct nvos00 f;
	struct nvos54 c;
	uint32_t i = (uint32_t)(uintptr_t)arg << 16;
	int fd;

	fd = open(node, O_RDWR);
	if (fd < 0)
		return NULL;
	atomic_fetch_add(&tot->opens, 1);
	while (now() < deadline) {
		memset(&f, 0, sizeof(f));
		f.h_root = 0xC1000000u + i;
		f.h_parent = f.h_root;
		f.h_object = 0xC2000000u + i;
		count(ioctl(fd, _IOWR(NV_IOCTL_MAGIC, NV_ESC_RM_FREE,
				      struct nvos00), &f));
		memset(&c, 0, sizeof(c));
		c.h_client = 0xC1000000u + i;
		c.h_object = 0xC3000000u + i;
		c.cmd = FB_GET_INFO_V2;
		c.params = (uintptr_t)big;
		c.params_size = BIG;
		count(ioctl(fd, _IOWR(NV_IOCTL_MAGIC, NV_ESC_RM_CONTROL,
				      struct nvos54), &c));
		i++;
	}
	close(fd);
	return NULL;
}

static void run(int threads, int proc)
{
	pthread_t *t = calloc(threads, sizeof(*t));
	int i, n = 0;

	if (!t)
		exit(1);
	for (i = 0; i < threads; i++)
		if (!pthread_create(&t[n], NULL, flood,
				    (void *)(uintptr_t)(proc * threads + i)))
			n++;
	for (i = 0; i < n; i++)
		pthread_join(t[i], NULL);
	free(t);
}

int main(int argc, char **argv)
{
	int procs, threads, i;
	double seconds;

	if (argc < 5)
		return 2;
	node = argv[1];
	procs = atoi(argv[2]);
	threads = atoi(argv[3]);
	seconds = atof(argv[4]);
	tot = mmap(NULL, sizeof(*tot), PROT_READ | PROT_WRITE,
		   MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (tot == MAP_FAILED)
		return 1;
	deadline = now() + seconds;
	for (i = 1; i < procs; i++) {
		pid_t pid = fork();

		if (pid < 0)
			break;
		if (!pid) {
			run(threads, i);
			_exit(0);
		}
	}
	run(threads, 0);
	while (wait(NULL) > 0)
		;
	printf("calls %lu ok %lu hostdown %lu timedout %lu intr %lu other %lu opens %lu procs %d threads %d\n",
	       tot->calls, tot->ok, tot->hostdown, tot->timedout, tot->intr,
	       tot->other, tot->opens, procs, threads);
	return 0;
}
