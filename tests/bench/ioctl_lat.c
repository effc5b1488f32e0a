// SPDX-License-Identifier: GPL-2.0
/*
 * ioctl_lat: per-call latency of one RM_CONTROL ioctl on two nodes,
 * interleaved in rounds so that both see the same machine noise.
 *
 *   ioctl_lat NODE_A NODE_B ROUNDS CALLS_PER_ROUND CTRL_CMD [xfer]
 *
 * Each call is an RM_CONTROL (NVOS54, 32 B) with cmd CTRL_CMD on a handle
 * the driver does not know: the driver answers with a status, cheaply, so the
 * figure is the cost of the path, not of the work. With "xfer" each call is
 * wrapped in IOCTL_XFER_CMD. Prints, per node, the
 * p50, p90, p99 and mean in nanoseconds, and the ratio B/A of the p50s.
 */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

struct nvos54 {
	uint32_t h_client, h_object, cmd, flags;
	uint64_t params;
	uint32_t params_size, status;
};

struct xfer {
	uint32_t cmd, size;
	uint64_t ptr;
};

#define RM_CONTROL _IOWR('F', 0x2A, struct nvos54)
#define XFER_CMD _IOWR('F', 211, struct xfer)

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + ts.tv_nsec;
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

	return x < y ? -1 : x > y;
}

static void report(const char *name, uint64_t *v, size_t n, uint64_t *p50)
{
	double sum = 0;
	size_t i;

	qsort(v, n, sizeof(*v), cmp_u64);
	for (i = 0; i < n; i++)
		sum += v[i];
	*p50 = v[n / 2];
	printf("%-28s p50 %8llu ns  p90 %8llu ns  p99 %8llu ns  mean %10.0f ns  n %zu\n",
	       name, (unsigned long long)v[n / 2],
	       (unsigned long long)v[n * 90 / 100],
	       (unsigned long long)v[n * 99 / 100], sum / n, n);
}

int main(int argc, char **argv)
{
	int fd[2], rounds, per, r, k, i;
	uint64_t *lat[2], p50[2];
	uint32_t ctrl;
	size_t n = 0;
	int xfer;

	xfer = argc == 7 && !strcmp(argv[6], "xfer");
	if (argc != 6 && !xfer) {
		fprintf(stderr, "usage: %s NODE_A NODE_B ROUNDS CALLS CTRL_CMD [xfer]\n", argv[0]);
		return 2;
	}
	rounds = atoi(argv[3]);
	per = atoi(argv[4]);
	ctrl = strtoul(argv[5], NULL, 0);
	for (k = 0; k < 2; k++) {
		fd[k] = open(argv[1 + k], O_RDWR);
		if (fd[k] < 0) {
			perror(argv[1 + k]);
			return 1;
		}
		lat[k] = calloc((size_t)rounds * per, sizeof(uint64_t));
		if (!lat[k])
			return 1;
	}
	for (r = 0; r < rounds; r++) {
		for (k = 0; k < 2; k++) {
			for (i = 0; i < per; i++) {
				struct nvos54 p = { .h_client = 0xbad0001,
						    .h_object = 0xbad0002,
						    .cmd = ctrl };
				struct xfer x = { 0x2A, sizeof(p), (uintptr_t)&p };
				uint64_t t0 = now_ns();
				int ret = xfer ? ioctl(fd[k], XFER_CMD, &x) :
						 ioctl(fd[k], RM_CONTROL, &p);

				if (ret < 0) {
					perror("ioctl");
					return 1;
				}
				lat[k][n + i] = now_ns() - t0;
			}
		}
		n += per;
	}
	report(argv[1], lat[0], n, &p50[0]);
	report(argv[2], lat[1], n, &p50[1]);
	printf("ratio p50 %s / %s = %.3f\n", argv[2], argv[1],
	       (double)p50[1] / (double)p50[0]);
	return 0;
}
