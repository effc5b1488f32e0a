/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The nvtrace file format: what libnvtrace.so writes, one file per process.
 * Documented in docs/nvtrace.md; read by tools/nvtrace/fmt.py, which pins
 * every size and offset below against gcc (tests/unit/test_nvtrace_format.py).
 *
 * A file is a header, metadata entries, then records, all little-endian
 * (x86-64 and arm64 hosts), every part 8-byte aligned:
 *
 *   struct nvtrace_header
 *   meta_size bytes of { struct nvtrace_meta; value; pad to 8 }
 *   records: { struct nvtrace_record; nblocks x { struct nvtrace_block;
 *              data; pad to 8 } }, record.size bytes each
 *
 * Version history (append-only: a reader refuses a version it does not know):
 *   1  first version
 *   2  an RM_ALLOC's alloc params block is a window of `window` bytes (up to
 *      the first unreadable page), not paramsSize bytes: the driver takes
 *      the size from the object class
 */
#ifndef NVTRACE_H
#define NVTRACE_H

#include <stdint.h>

#define NVTRACE_MAGIC		"NVTRACE"	/* 8 bytes with its NUL */
#define NVTRACE_VERSION		2

/* Header flags. */
#define NVTRACE_H_UNSAFE_COPY	(1u << 0)	/* process_vm_readv refused: memcpy */

struct nvtrace_header {
	char magic[8];
	uint16_t version;
	uint16_t header_size;	/* sizeof(struct nvtrace_header) */
	uint32_t meta_size;	/* bytes of metadata after the header */
	uint32_t pid;
	uint32_t ppid;
	uint64_t realtime_ns;	/* CLOCK_REALTIME when the file was made */
	uint64_t monotonic_ns;	/* CLOCK_MONOTONIC at the same moment */
	uint32_t flags;		/* NVTRACE_H_* */
	uint32_t max_block;	/* largest block copied (bytes) */
	uint32_t window;	/* bytes copied where the call has no size */
	uint32_t reserved;
};

/* Metadata tags: text values, no NUL (CMDLINE: arguments NUL-separated). */
enum nvtrace_meta_tag {
	NVTRACE_M_DRIVER = 1,	/* first line of /proc/driver/nvidia/version */
	NVTRACE_M_GPU = 2,	/* "Model:" of a /proc/driver/nvidia/gpus entry */
	NVTRACE_M_COMM = 3,
	NVTRACE_M_CMDLINE = 4,
	NVTRACE_M_EXE = 5,
	NVTRACE_M_UNAME = 6,	/* sysname release version machine */
	NVTRACE_M_PREFIXES = 7,	/* the traced path prefixes, ':'-separated */
	NVTRACE_M_MODULE_VERSION = 8,	/* /sys/module/nvidia/version */
};

struct nvtrace_meta {
	uint16_t tag;
	uint16_t len;		/* bytes of value that follow */
};

enum nvtrace_kind {
	NVTRACE_IOCTL = 1,	/* arg: request, argp */
	NVTRACE_MMAP = 2,	/* arg: addr, length, prot | flags << 32, offset */
	NVTRACE_OPEN = 3,	/* arg: flags, mode, how (NVTRACE_OPEN_*), old fd */
	NVTRACE_CLOSE = 4,
};

/* How a traced fd became known (OPEN record, arg[2]). */
enum nvtrace_open_how {
	NVTRACE_OPEN_CALL = 0,	/* open/openat returned it */
	NVTRACE_OPEN_FOUND = 1,	/* first seen in a call: opened elsewhere */
	NVTRACE_OPEN_DUP = 2,	/* dup/dup2/dup3 of arg[3] */
};

struct nvtrace_record {
	uint32_t size;		/* bytes of the record with its blocks */
	uint16_t kind;		/* enum nvtrace_kind */
	uint16_t nblocks;
	uint32_t seq;		/* per process, from 0, in the order calls began */
	uint32_t tid;
	uint64_t start_ns;	/* CLOCK_MONOTONIC at entry */
	uint64_t end_ns;	/* at return */
	int64_t ret;		/* the call's return value (mmap: the address) */
	int32_t err;		/* errno when the call failed, else 0 */
	int32_t fd;
	uint64_t arg[4];
};

/* Blocks: user memory around a call. */
enum nvtrace_block_tag {
	NVTRACE_B_ARG = 1,	/* the ioctl's params at argp */
	NVTRACE_B_XFER = 2,	/* the params an IOCTL_XFER_CMD wrapper points to */
	NVTRACE_B_PTR = 3,	/* the buffer the (inner) params point to */
	NVTRACE_B_PATH = 4,	/* OPEN: the path */
};

#define NVTRACE_BF_OUT		(1u << 0)	/* read after the call */
#define NVTRACE_BF_FAULT	(1u << 1)	/* unreadable (err); len: what was read */
#define NVTRACE_BF_TRUNC	(1u << 2)	/* want > max_block: cut */

struct nvtrace_block {
	uint16_t tag;		/* enum nvtrace_block_tag */
	uint16_t flags;		/* NVTRACE_BF_* */
	uint32_t len;		/* bytes of data that follow (then pad to 8) */
	uint64_t addr;		/* where they were read */
	uint32_t want;		/* bytes the call names */
	int32_t err;		/* errno of a failed read, else 0 */
};

_Static_assert(sizeof(struct nvtrace_header) == 56, "nvtrace_header");
_Static_assert(sizeof(struct nvtrace_meta) == 4, "nvtrace_meta");
_Static_assert(sizeof(struct nvtrace_record) == 80, "nvtrace_record");
_Static_assert(sizeof(struct nvtrace_block) == 24, "nvtrace_block");

#endif /* NVTRACE_H */
