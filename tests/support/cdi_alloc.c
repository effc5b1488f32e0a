// SPDX-License-Identifier: GPL-2.0
/*
 * A container's GPU workload for tests/vm/test_cdi_podman.py, built static so
 * that an image of this one file runs: through /dev/nvidiactl (the path the
 * CDI spec maps the tenant's node to) it builds a client, device 0 and its
 * subdevice, then allocates COUNT blocks of SIZE MiB of video memory.
 *
 *   cdi_alloc SIZE_MIB COUNT [fork] [hold]
 *
 * Prints "open errno N" (and exits 2) when the open is refused, else one
 * "alloc I errno E status S" line per block (S in hex, as the driver
 * answers), then, with hold, "holding", and keeps its memory until SIGTERM.
 * With fork, a child process does all that (it prints "child pid N" first,
 * its pid in the container) while the main process waits for it, and passes
 * SIGTERM on: the container's main process never opens the node.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "attack.h"

#define NV01_ROOT_CLIENT	0x41
#define NV01_MEMORY_LOCAL_USER	0x40
#define NV01_DEVICE_0		0x80
#define NV20_SUBDEVICE_0	0x2080
#define DEVICE_PARAMS_SIZE	56	/* NV0080_ALLOC_PARAMETERS: deviceId first */
#define MEMORY_PARAMS_SIZE	128	/* NV_MEMORY_ALLOCATION_PARAMS */
#define MEMORY_SIZE_OFFSET	64

static int rm_alloc(int ctl, uint32_t root, uint32_t parent, uint32_t class, void *params,
		    uint32_t *handle, uint32_t *status)
{
	struct nvos21 a = {
		.h_root = root, .h_parent = parent, .h_class = class,
		.p_alloc_parms = (uintptr_t)params,
	};

	if (ioctl(ctl, _IOWR(NV_IOCTL_MAGIC, NV_ESC_RM_ALLOC, struct nvos21), &a) < 0)
		return errno;
	*handle = a.h_new;
	*status = a.status;
	return 0;
}

static void must(int err, uint32_t status, const char *what)
{
	if (err || status) {
		printf("%s errno %d status 0x%x\n", what, err, status);
		exit(3);
	}
}

static pid_t child;

static void stop(int sig)
{
	(void)sig;
	if (child > 0)
		kill(child, SIGTERM);
	_exit(0);
}

static int has_arg(int argc, char **argv, const char *word)
{
	int i;

	for (i = 3; i < argc; i++)
		if (!strcmp(argv[i], word))
			return 1;
	return 0;
}

int main(int argc, char **argv)
{
	uint8_t device[DEVICE_PARAMS_SIZE] = { 0 }, memory[MEMORY_PARAMS_SIZE];
	uint32_t client, dev, sub, mem, status, subdevice_id = 0;
	uint64_t size;
	int ctl, count, i, err, wstatus;

	if (argc < 3) {
		fprintf(stderr, "usage: cdi_alloc SIZE_MIB COUNT [hold]\n");
		return 1;
	}
	/* PID 1 of a container ignores signals it has no handler for. */
	signal(SIGTERM, stop);
	setvbuf(stdout, NULL, _IOLBF, 0);
	size = strtoull(argv[1], NULL, 10) << 20;
	count = atoi(argv[2]);
	if (has_arg(argc, argv, "fork")) {
		child = fork();
		if (child < 0) {
			printf("fork errno %d\n", errno);
			return 4;
		}
		if (child > 0) {
			while (waitpid(child, &wstatus, 0) < 0 && errno == EINTR)
				;
			return WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : 5;
		}
		printf("child pid %d\n", (int)getpid());
	}
	ctl = open("/dev/nvidiactl", O_RDWR);
	if (ctl < 0) {
		printf("open errno %d\n", errno);
		return 2;
	}
	err = rm_alloc(ctl, 0, 0, NV01_ROOT_CLIENT, NULL, &client, &status);
	must(err, status, "client");
	err = rm_alloc(ctl, client, client, NV01_DEVICE_0, device, &dev, &status);
	must(err, status, "device");
	err = rm_alloc(ctl, client, dev, NV20_SUBDEVICE_0, &subdevice_id, &sub, &status);
	must(err, status, "subdevice");
	for (i = 0; i < count; i++) {
		memset(memory, 0, sizeof(memory));
		memcpy(memory + MEMORY_SIZE_OFFSET, &size, sizeof(size));
		status = 0;
		err = rm_alloc(ctl, client, dev, NV01_MEMORY_LOCAL_USER, memory, &mem, &status);
		printf("alloc %d errno %d status 0x%x\n", i, err, status);
	}
	if (has_arg(argc, argv, "hold")) {
		printf("holding\n");
		for (;;)
			pause();
	}
	return 0;
}
