// SPDX-License-Identifier: GPL-2.0
/*
 * A hostile tenant's race on the fd arguments of its calls (tests/vm/hostile).
 *
 *   attack_fdwin VGPU_DIR MIN_S MAX_S ATTEMPTS THIEVES MAX_FORKS
 *
 * The main thread loops NV_ESC_REGISTER_FD (on nvidia0, naming nvidiactl)
 * and NV_ESC_RM_MAP_MEMORY (on nvidiactl, naming nvidia0) through VGPU_DIR:
 * calls whose fd field the module translates while the call runs. THIEVES
 * sibling threads loop dup (F_DUPFD, to fds >= 512 so that the low fds stay
 * free) on the lowest fds that are not the tenant's own, and keep every
 * character device whose number is not one of VGPU_DIR's: what they got of
 * the driver's (up to an fd limit of MAX_FDS). A forker thread forks now and then (at most MAX_FORKS
 * children); a child keeps the fd table it got and waits for its parent to
 * exit. The race runs for at least MIN_S seconds and ATTEMPTS calls (at most
 * MAX_S s); then it prints
 *
 *   attempts N captured N others N forks N
 *
 * (captured: dups of a driver node, a /dev path; others: of any other
 * character file that is not VGPU_DIR's)
 *
 * and waits for a line on stdin (the test scans /proc/<pid>/fd meanwhile)
 * before it exits.
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
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "attack.h"

#define LOW_FDS			32
#define KEEP_FROM		512
#define MAX_FDS			16384

struct nvos33_with_fd {
	uint32_t h_client, h_device, h_memory, pad;
	uint64_t offset, length, p_linear_address;
	uint32_t status, flags;
	int32_t fd;
	uint32_t pad2;
};

static atomic_int stop;
static atomic_ulong captured;	/* dups of a driver node (a /dev path) */
static atomic_ulong others;	/* dups of any other char file: proxies */
static unsigned int vgpu_major;
static int own[LOW_FDS];	/* 1: an fd of the tenant's own, never touched */
static int hold_r = -1, hold_w = -1;	/* children wait on it for EOF */

static void *thief(void *arg)
{
	char link[64], target[256];
	struct stat st;
	ssize_t n;
	int fd, d;

	(void)arg;
	while (!atomic_load_explicit(&stop, memory_order_relaxed)) {
		for (fd = 3; fd < LOW_FDS; fd++) {
			if (own[fd])
				continue;
			d = fcntl(fd, F_DUPFD, KEEP_FROM);
			if (d < 0)
				continue;
			if (!fstat(d, &st) && S_ISCHR(st.st_mode) &&
			    major(st.st_rdev) != vgpu_major) {
				snprintf(link, sizeof(link), "/proc/self/fd/%d", d);
				n = readlink(link, target, sizeof(target) - 1);
				if (n > 5 && !memcmp(target, "/dev/", 5))
					atomic_fetch_add(&captured, 1);
				else
					atomic_fetch_add(&others, 1);
				continue;	/* kept */
			}
			close(d);
		}
	}
	return NULL;
}

static void *forker(void *arg)
{
	unsigned long *forks = arg;
	unsigned long max = forks[1];
	char c;
	pid_t p;

	while (!atomic_load_explicit(&stop, memory_order_relaxed) &&
	       forks[0] < max) {
		p = fork();
		if (p == 0) {
			close(hold_w);
			/* Keeps the fd table it got until the parent exits. */
			while (read(hold_r, &c, 1) > 0)
				;
			_exit(0);
		}
		if (p > 0)
			forks[0]++;
		usleep(20000);
	}
	return NULL;
}

int main(int argc, char **argv)
{
	unsigned long attempts = 0, want, forks[2] = { 0, 0 };
	struct nvos33_with_fd map;
	double start, min_s, max_s;
	pthread_t *thieves, ft;
	int ctl, gpu, hold[2], n_thieves, i, reg;
	struct rlimit rl;
	struct stat st;
	char path[256];
	char line[16];

	if (argc < 7)
		return 2;
	min_s = atof(argv[2]);
	max_s = atof(argv[3]);
	want = strtoul(argv[4], NULL, 0);
	n_thieves = atoi(argv[5]);
	forks[1] = strtoul(argv[6], NULL, 0);

	/* Room to keep what it gets, bounded so the test's scans stay short. */
	if (!getrlimit(RLIMIT_NOFILE, &rl)) {
		rl.rlim_cur = rl.rlim_max < MAX_FDS ? rl.rlim_max : MAX_FDS;
		setrlimit(RLIMIT_NOFILE, &rl);
	}
	snprintf(path, sizeof(path), "%s/nvidiactl", argv[1]);
	ctl = open(path, O_RDWR);
	snprintf(path, sizeof(path), "%s/nvidia0", argv[1]);
	gpu = open(path, O_RDWR);
	if (ctl < 0 || gpu < 0 || pipe(hold) || fstat(ctl, &st)) {
		perror("open");
		return 1;
	}
	vgpu_major = major(st.st_rdev);
	hold_r = hold[0];
	hold_w = hold[1];
	for (i = 0; i < 3; i++)
		own[i] = 1;
	own[ctl] = own[gpu] = own[hold[0]] = own[hold[1]] = 1;

	thieves = calloc(n_thieves, sizeof(*thieves));
	for (i = 0; i < n_thieves; i++)
		pthread_create(&thieves[i], NULL, thief, NULL);
	pthread_create(&ft, NULL, forker, forks);

	start = now();
	for (;;) {
		double t = now() - start;

		if (t >= max_s || (t >= min_s && attempts >= want))
			break;
		reg = ctl;
		ioctl(gpu, _IOWR(NV_IOCTL_MAGIC, NV_ESC_REGISTER_FD, int), &reg);
		memset(&map, 0, sizeof(map));
		map.h_client = 0xc1d00001;
		map.length = 4096;
		map.fd = gpu;
		ioctl(ctl, _IOWR(NV_IOCTL_MAGIC, NV_ESC_RM_MAP_MEMORY,
				 struct nvos33_with_fd), &map);
		attempts += 2;
	}
	atomic_store(&stop, 1);
	for (i = 0; i < n_thieves; i++)
		pthread_join(thieves[i], NULL);
	pthread_join(ft, NULL);

	printf("attempts %lu captured %lu others %lu forks %lu\n", attempts,
	       atomic_load(&captured), atomic_load(&others), forks[0]);
	fflush(stdout);
	if (!fgets(line, sizeof(line), stdin))
		line[0] = 0;
	close(hold[1]);
	while (wait(NULL) > 0 || errno == EINTR)
		;
	return 0;
}
