// SPDX-License-Identifier: GPL-2.0
/*
 * libnvtrace.so: an LD_PRELOAD recorder of what a process sends the NVIDIA
 * driver. Every ioctl and mmap on a traced device file (a path under one of
 * the traced prefixes) is written, with the params before and after the call,
 * to a file of the process's own (format: nvtrace.h, docs/nvtrace.md).
 * Children inherit LD_PRELOAD and the settings through the environment.
 *
 *   NVTRACE_DIR         where the files go (default "."):
 *                       COMM-PID.nvtrace, COMM-PID.N.nvtrace after an exec
 *   NVTRACE_PREFIXES    ':'-separated path prefixes (default "/dev/nvidia")
 *   NVTRACE_MAX_BLOCK   largest block copied, bytes (default 1 MiB)
 *   NVTRACE_WINDOW      bytes copied where the call does not tell the size:
 *                       an nvidia-uvm call's argument, the alloc params an
 *                       RM_ALLOC points to (default 4096)
 *
 * An NVIDIA escape's params are _IOC_SIZE bytes at the argument; an
 * IOCTL_XFER_CMD wrapper's payload and the buffer an RM_ALLOC or RM_CONTROL
 * points to are copied too. User memory is read with process_vm_readv, so a
 * bad pointer is recorded as a fault rather than crashing the caller.
 *
 * Threads: a record is built on the caller's stack and heap and written with
 * one writev() to an O_APPEND file, so records of concurrent calls never
 * interleave. The fd table is an array of atomics; the file is created once
 * under a mutex, and again in a child after fork().
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#include "nvtrace.h"

#define FD_SLOTS	65536	/* fds beyond are never traced */
#define MAX_PREFIXES	16
#define MAX_BLOCKS	8	/* ARG, XFER, PTR in and out; PATH */
#define META_MAX	4096	/* bytes of one metadata value */
#define PAGE		4096u
#define CHUNK_PAGES	64	/* iovecs per process_vm_readv */

#define ESC_RM_CONTROL	0x2a
#define ESC_RM_ALLOC	0x2b
#define ESC_XFER	211

enum fd_kind { FD_UNKNOWN, FD_OTHER, FD_NV, FD_UVM };

static _Atomic unsigned char fd_kind[FD_SLOTS];

/* Settings (set once, by nvt_setup) and the output file. */
static struct {
	pthread_once_t once;
	pthread_mutex_t lock;	/* serializes making the output file */
	_Atomic int out;	/* output fd; -1 none yet, -2 cannot write */
	_Atomic unsigned int seq;
	_Atomic int unsafe_copy;	/* process_vm_readv refused: memcpy */
	_Atomic int pid;
	char dir[PATH_MAX];
	char prefixes[MAX_PREFIXES][PATH_MAX];
	int nprefixes;
	uint32_t max_block;
	uint32_t window;
} nvt = {
	.once = PTHREAD_ONCE_INIT,
	.lock = PTHREAD_MUTEX_INITIALIZER,
	.out = -1,
};

/* The next definitions of the symbols we wrap. */
static int (*real_ioctl)(int, unsigned long, ...);
static void *(*real_mmap)(void *, size_t, int, int, int, off_t);
static void *(*real_mmap64)(void *, size_t, int, int, int, off64_t);
static int (*real_open)(const char *, int, ...);
static int (*real_open64)(const char *, int, ...);
static int (*real_openat)(int, const char *, int, ...);
static int (*real_openat64)(int, const char *, int, ...);
static int (*real___open_2)(const char *, int);
static int (*real___open64_2)(const char *, int);
static int (*real___openat_2)(int, const char *, int);
static int (*real___openat64_2)(int, const char *, int);
static int (*real_close)(int);
static int (*real_dup)(int);
static int (*real_dup2)(int, int);
static int (*real_dup3)(int, int, int);

#define RESOLVE(name) do {						\
	if (!real_##name)						\
		real_##name = dlsym(RTLD_NEXT, #name);			\
} while (0)

struct block {
	struct nvtrace_block h;
	void *data;
};

struct rec {
	struct nvtrace_record h;
	struct block b[MAX_BLOCKS];
	int n;
};

static uint64_t now_ns(clockid_t clk)
{
	struct timespec ts;

	clock_gettime(clk, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint32_t env_u32(const char *name, uint32_t dflt)
{
	const char *v = getenv(name);
	char *end;
	unsigned long n;

	if (!v || !*v)
		return dflt;
	n = strtoul(v, &end, 0);
	return (*end || n > (1u << 30)) ? dflt : (uint32_t)n;
}

static void parse_prefixes(const char *spec)
{
	const char *p = spec;
	size_t len;

	while (*p && nvt.nprefixes < MAX_PREFIXES) {
		len = strcspn(p, ":");
		if (len && len < PATH_MAX) {
			memcpy(nvt.prefixes[nvt.nprefixes], p, len);
			nvt.prefixes[nvt.nprefixes++][len] = '\0';
		}
		p += len;
		if (*p == ':')
			p++;
	}
}

static void child_after_fork(void);

/* Whether process_vm_readv works here (a seccomp filter may refuse it). */
static void probe_copy(void)
{
	static const char probe = 1;
	char got = 0;
	struct iovec loc = { &got, 1 }, rem = { (void *)&probe, 1 };

	if (process_vm_readv(getpid(), &loc, 1, &rem, 1, 0) != 1)
		atomic_store(&nvt.unsafe_copy, 1);
}

static void nvt_setup(void)
{
	const char *dir = getenv("NVTRACE_DIR");
	const char *prefixes = getenv("NVTRACE_PREFIXES");

	snprintf(nvt.dir, sizeof(nvt.dir), "%s", dir && *dir ? dir : ".");
	parse_prefixes(prefixes && *prefixes ? prefixes : "/dev/nvidia");
	nvt.max_block = env_u32("NVTRACE_MAX_BLOCK", 1u << 20);
	nvt.window = env_u32("NVTRACE_WINDOW", 4096);
	atomic_store(&nvt.pid, getpid());
	probe_copy();
	pthread_atfork(NULL, NULL, child_after_fork);
}

static void setup(void)
{
	pthread_once(&nvt.once, nvt_setup);
}

static uint32_t tid(void)
{
	static __thread uint32_t cached;

	if (!cached)
		cached = (uint32_t)syscall(SYS_gettid);
	return cached;
}

/*
 * A child gets a file of its own (the parent's stays the parent's), where
 * the traced fds it inherited are recorded again (OPEN_FOUND) at first use.
 */
static void child_after_fork(void)
{
	int out = atomic_exchange(&nvt.out, -1);
	unsigned char kind;
	int fd;

	for (fd = 0; fd < FD_SLOTS; fd++) {
		kind = atomic_load_explicit(&fd_kind[fd], memory_order_relaxed);
		if (kind == FD_NV || kind == FD_UVM)
			atomic_store(&fd_kind[fd], FD_UNKNOWN);
	}
	pthread_mutex_init(&nvt.lock, NULL);
	atomic_store(&nvt.pid, getpid());
	atomic_store(&nvt.seq, 0);
	if (out >= 0) {
		RESOLVE(close);
		real_close(out);
	}
}

/* --- user memory ------------------------------------------------------- */

/*
 * Copies up to len bytes at addr, page by page, stopping at the first
 * unreadable page. Returns the bytes copied; *err is EFAULT when short.
 */
static size_t read_user(void *dst, uint64_t addr, size_t len, int *err)
{
	struct iovec loc[CHUNK_PAGES], rem[CHUNK_PAGES];
	size_t done = 0, piece;
	ssize_t got;
	int i, want;

	*err = 0;
	while (done < len && !atomic_load(&nvt.unsafe_copy)) {
		want = 0;
		for (i = 0; i < CHUNK_PAGES && done + want < len; i++) {
			uint64_t a = addr + done + want;

			piece = PAGE - (a & (PAGE - 1));
			if (piece > len - done - want)
				piece = len - done - want;
			loc[i] = (struct iovec){ (char *)dst + done + want, piece };
			rem[i] = (struct iovec){ (void *)(uintptr_t)a, piece };
			want += piece;
		}
		got = process_vm_readv(atomic_load(&nvt.pid), loc, i, rem, i, 0);
		if (got < 0 && (errno == ENOSYS || errno == EPERM)) {
			atomic_store(&nvt.unsafe_copy, 1);
			break;
		}
		if (got < 0)
			got = 0;
		done += got;
		if (got < want) {
			*err = EFAULT;
			return done;
		}
	}
	if (done < len) {	/* process_vm_readv refused: trust the caller */
		memcpy((char *)dst + done, (void *)(uintptr_t)(addr + done),
		       len - done);
		done = len;
	}
	return done;
}

/* Adds a block of want bytes at addr, read now. */
static struct block *add_block(struct rec *r, uint16_t tag, uint16_t flags,
			       uint64_t addr, uint32_t want)
{
	struct block *b;
	uint32_t len = want < nvt.max_block ? want : nvt.max_block;
	int err = 0;

	if (r->n >= MAX_BLOCKS)
		return NULL;
	b = &r->b[r->n];
	b->data = len ? malloc(len) : NULL;
	if (len && !b->data)
		return NULL;
	r->n++;
	b->h = (struct nvtrace_block){ .tag = tag, .flags = flags,
				       .addr = addr, .want = want };
	if (len)
		b->h.len = (uint32_t)read_user(b->data, addr, len, &err);
	if (err) {
		b->h.flags |= NVTRACE_BF_FAULT;
		b->h.err = err;
	}
	if (want > len)
		b->h.flags |= NVTRACE_BF_TRUNC;
	return b;
}

static void free_blocks(struct rec *r)
{
	int i;

	for (i = 0; i < r->n; i++)
		free(r->b[i].data);
}

static uint32_t get_u32(const struct block *b, uint32_t off)
{
	uint32_t v;

	memcpy(&v, (const char *)b->data + off, sizeof(v));
	return v;
}

static uint64_t get_u64(const struct block *b, uint32_t off)
{
	uint64_t v;

	memcpy(&v, (const char *)b->data + off, sizeof(v));
	return v;
}

/* A block read in full (not cut, not faulted) of exactly size bytes. */
static int whole(const struct block *b, uint32_t size)
{
	return b && !(b->h.flags & (NVTRACE_BF_FAULT | NVTRACE_BF_TRUNC)) &&
	       b->h.len == size;
}

/* --- the output file --------------------------------------------------- */

struct meta_buf {
	char *p;
	size_t len, cap;
};

static void meta_add(struct meta_buf *m, uint16_t tag, const char *v, size_t n)
{
	struct nvtrace_meta e = { .tag = tag };
	size_t need;
	char *grown;

	if (n > META_MAX)
		n = META_MAX;
	need = (sizeof(e) + n + 7) & ~(size_t)7;
	if (m->len + need > m->cap) {
		grown = realloc(m->p, (m->len + need) * 2);
		if (!grown)
			return;
		m->p = grown;
		m->cap = (m->len + need) * 2;
	}
	e.len = (uint16_t)n;
	memset(m->p + m->len, 0, need);
	memcpy(m->p + m->len, &e, sizeof(e));
	memcpy(m->p + m->len + sizeof(e), v, n);
	m->len += need;
}

/* A file's first bytes (up to META_MAX), trailing newlines and NULs cut. */
static size_t slurp(const char *path, char *buf, int first_line)
{
	FILE *f = fopen(path, "re");
	size_t n;

	if (!f)
		return 0;
	n = fread(buf, 1, META_MAX, f);
	fclose(f);
	if (first_line)
		n = strcspn(buf, "\n") < n ? strcspn(buf, "\n") : n;
	while (n && (buf[n - 1] == '\n' || buf[n - 1] == '\0'))
		n--;
	return n;
}

static void meta_file(struct meta_buf *m, uint16_t tag, const char *path,
		      int first_line)
{
	char buf[META_MAX + 1] = "";
	size_t n = slurp(path, buf, first_line);

	if (n)
		meta_add(m, tag, buf, n);
}

/* The "Model:" line of each GPU the driver lists. */
static void meta_gpus(struct meta_buf *m)
{
	DIR *d = opendir("/proc/driver/nvidia/gpus");
	char path[PATH_MAX], buf[META_MAX + 1];
	struct dirent *e;
	char *model, *end;

	if (!d)
		return;
	while ((e = readdir(d))) {
		if (e->d_name[0] == '.')
			continue;
		snprintf(path, sizeof(path), "/proc/driver/nvidia/gpus/%s/information",
			 e->d_name);
		buf[slurp(path, buf, 0)] = '\0';
		model = strstr(buf, "Model:");
		if (!model)
			continue;
		model += strlen("Model:");
		model += strspn(model, " \t");
		end = model + strcspn(model, "\n");
		meta_add(m, NVTRACE_M_GPU, model, end - model);
	}
	closedir(d);
}

static void meta_process(struct meta_buf *m)
{
	char buf[PATH_MAX];
	struct utsname u;
	ssize_t n;
	int i;

	meta_file(m, NVTRACE_M_COMM, "/proc/self/comm", 1);
	meta_file(m, NVTRACE_M_CMDLINE, "/proc/self/cmdline", 0);
	n = readlink("/proc/self/exe", buf, sizeof(buf));
	if (n > 0)
		meta_add(m, NVTRACE_M_EXE, buf, n);
	if (!uname(&u)) {
		n = snprintf(buf, sizeof(buf), "%s %s %s %s", u.sysname,
			     u.release, u.version, u.machine);
		meta_add(m, NVTRACE_M_UNAME, buf, n < (ssize_t)sizeof(buf) ?
			 (size_t)n : sizeof(buf) - 1);
	}
	buf[0] = '\0';
	for (i = 0; i < nvt.nprefixes; i++) {
		strncat(buf, i ? ":" : "", sizeof(buf) - strlen(buf) - 1);
		strncat(buf, nvt.prefixes[i], sizeof(buf) - strlen(buf) - 1);
	}
	meta_add(m, NVTRACE_M_PREFIXES, buf, strlen(buf));
}

static int write_all(int fd, const void *p, size_t n)
{
	ssize_t w;

	while (n) {
		w = write(fd, p, n);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			return -1;
		p = (const char *)p + w;
		n -= w;
	}
	return 0;
}

static int write_header(int fd)
{
	struct meta_buf m = { 0 };
	struct nvtrace_header h = {
		.magic = NVTRACE_MAGIC,
		.version = NVTRACE_VERSION,
		.header_size = sizeof(h),
		.pid = (uint32_t)atomic_load(&nvt.pid),
		.ppid = (uint32_t)getppid(),
		.realtime_ns = now_ns(CLOCK_REALTIME),
		.monotonic_ns = now_ns(CLOCK_MONOTONIC),
		.max_block = nvt.max_block,
		.window = nvt.window,
		.flags = atomic_load(&nvt.unsafe_copy) ? NVTRACE_H_UNSAFE_COPY : 0,
	};
	int ret;

	meta_file(&m, NVTRACE_M_DRIVER, "/proc/driver/nvidia/version", 1);
	meta_file(&m, NVTRACE_M_MODULE_VERSION, "/sys/module/nvidia/version", 1);
	meta_gpus(&m);
	meta_process(&m);
	h.meta_size = (uint32_t)m.len;
	ret = write_all(fd, &h, sizeof(h));
	if (!ret && m.len)
		ret = write_all(fd, m.p, m.len);
	free(m.p);
	return ret;
}

/* COMM-PID.nvtrace, or COMM-PID.N.nvtrace if taken (an exec'd image). */
static int create_file(void)
{
	char comm[32] = "", path[sizeof(nvt.dir) + 64];
	size_t i, n = slurp("/proc/self/comm", comm, 1);
	int fd = -1, k;

	comm[n < sizeof(comm) ? n : sizeof(comm) - 1] = '\0';
	for (i = 0; comm[i]; i++)
		if (!(comm[i] == '.' || comm[i] == '_' || comm[i] == '-' ||
		      (comm[i] >= '0' && comm[i] <= '9') ||
		      ((comm[i] | 0x20) >= 'a' && (comm[i] | 0x20) <= 'z')))
			comm[i] = '_';
	RESOLVE(open);
	for (k = 0; k < 100 && fd < 0; k++) {
		if (k)
			snprintf(path, sizeof(path), "%s/%s-%d.%d.nvtrace", nvt.dir,
				 comm, atomic_load(&nvt.pid), k);
		else
			snprintf(path, sizeof(path), "%s/%s-%d.nvtrace", nvt.dir,
				 comm, atomic_load(&nvt.pid));
		fd = real_open(path, O_WRONLY | O_CREAT | O_EXCL | O_APPEND |
			       O_CLOEXEC, 0644);
		if (fd < 0 && errno != EEXIST)
			break;
	}
	if (fd >= 0 && write_header(fd)) {
		RESOLVE(close);
		real_close(fd);
		fd = -1;
	}
	if (fd < 0)
		fprintf(stderr, "nvtrace: cannot write a trace in %s: %s\n",
			nvt.dir, strerror(errno));
	return fd;
}

static int out_fd(void)
{
	int fd = atomic_load(&nvt.out);

	if (fd != -1)
		return fd;
	pthread_mutex_lock(&nvt.lock);
	fd = atomic_load(&nvt.out);
	if (fd == -1) {
		fd = create_file();
		atomic_store(&nvt.out, fd < 0 ? -2 : fd);
	}
	pthread_mutex_unlock(&nvt.lock);
	return fd;
}

/* One writev per record: O_APPEND keeps concurrent records whole. */
static void emit(struct rec *r)
{
	static const char pad[8];
	struct iovec iov[1 + 3 * MAX_BLOCKS];
	size_t total = sizeof(r->h), p;
	int i, k = 0, fd;

	for (i = 0; i < r->n; i++)
		total += sizeof(r->b[i].h) + ((r->b[i].h.len + 7u) & ~7u);
	r->h.size = (uint32_t)total;
	r->h.nblocks = (uint16_t)r->n;
	iov[k++] = (struct iovec){ &r->h, sizeof(r->h) };
	for (i = 0; i < r->n; i++) {
		iov[k++] = (struct iovec){ &r->b[i].h, sizeof(r->b[i].h) };
		iov[k++] = (struct iovec){ r->b[i].data, r->b[i].h.len };
		p = ((r->b[i].h.len + 7u) & ~7u) - r->b[i].h.len;
		iov[k++] = (struct iovec){ (void *)pad, p };
	}
	fd = out_fd();
	if (fd >= 0 && writev(fd, iov, k) < 0)
		fprintf(stderr, "nvtrace: write: %s\n", strerror(errno));
}

static void rec_init(struct rec *r, uint16_t kind, int fd)
{
	memset(r, 0, sizeof(*r));
	r->h.kind = kind;
	r->h.fd = fd;
	r->h.tid = tid();
	r->h.seq = atomic_fetch_add(&nvt.seq, 1);
	r->h.start_ns = now_ns(CLOCK_MONOTONIC);
	r->h.end_ns = r->h.start_ns;
}

/* --- which fds are traced ---------------------------------------------- */

static enum fd_kind path_kind(const char *path)
{
	const char *base = strrchr(path, '/');
	int i;

	for (i = 0; i < nvt.nprefixes; i++) {
		if (!strncmp(path, nvt.prefixes[i], strlen(nvt.prefixes[i]))) {
			base = base ? base + 1 : path;
			return strncmp(base, "nvidia-uvm", 10) ? FD_NV : FD_UVM;
		}
	}
	return FD_OTHER;
}

static ssize_t fd_path(int fd, char *buf, size_t size)
{
	char link[40];
	ssize_t n;

	snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
	n = readlink(link, buf, size - 1);
	buf[n > 0 ? n : 0] = '\0';
	return n;
}

static void emit_open(int fd, const char *path, uint64_t flags, uint64_t mode,
		      uint64_t how, int old)
{
	struct rec r;

	rec_init(&r, NVTRACE_OPEN, fd);
	r.h.ret = fd;
	r.h.arg[0] = flags;
	r.h.arg[1] = mode;
	r.h.arg[2] = how;
	r.h.arg[3] = (uint64_t)(int64_t)old;
	r.b[0].h = (struct nvtrace_block){ .tag = NVTRACE_B_PATH,
					   .len = (uint32_t)strlen(path),
					   .want = (uint32_t)strlen(path) };
	r.b[0].data = (void *)path;
	r.n = 1;
	emit(&r);
}

/* Sets fd's kind (from FD_UNKNOWN only) and records a traced one. */
static enum fd_kind learn(int fd, const char *path, uint64_t flags,
			  uint64_t mode, uint64_t how, int old)
{
	unsigned char expect = FD_UNKNOWN;
	enum fd_kind kind = path_kind(path);

	if (fd < 0 || fd >= FD_SLOTS)
		return FD_OTHER;
	if (how == NVTRACE_OPEN_FOUND) {
		if (!atomic_compare_exchange_strong(&fd_kind[fd], &expect, kind))
			return expect;	/* another thread learnt it first */
	} else {
		atomic_store(&fd_kind[fd], kind);
	}
	if (kind != FD_OTHER)
		emit_open(fd, path, flags, mode, how, old);
	return kind;
}

static enum fd_kind kind_of(int fd)
{
	char path[PATH_MAX];
	enum fd_kind kind;

	if (fd < 0 || fd >= FD_SLOTS)
		return FD_OTHER;
	kind = atomic_load(&fd_kind[fd]);
	if (kind != FD_UNKNOWN)
		return kind;
	setup();
	if (fd_path(fd, path, sizeof(path)) <= 0)
		return FD_OTHER;	/* not open: the call will say so */
	return learn(fd, path, 0, 0, NVTRACE_OPEN_FOUND, -1);
}

/* After an open or openat that returned fd. */
static void note_open(int fd, const char *path, int flags, mode_t mode)
{
	char buf[PATH_MAX];
	int saved = errno;

	if (fd < 0 || fd >= FD_SLOTS)
		return;
	setup();
	if (path[0] != '/') {
		if (fd_path(fd, buf, sizeof(buf)) <= 0)
			goto out;
		path = buf;
	}
	learn(fd, path, (uint64_t)flags, mode, NVTRACE_OPEN_CALL, -1);
out:
	errno = saved;
}

/* The app closed our output file (or dup'ed over it): make a new one. */
static void lose_out(int fd)
{
	int out = atomic_load(&nvt.out);

	if (out >= 0 && fd == out)
		atomic_compare_exchange_strong(&nvt.out, &out, -1);
}

/*
 * After fd was closed. pre: the CLOSE record begun before the close, so
 * that its seq comes before that of a new open reusing the number.
 */
static void note_close(int fd, enum fd_kind kind, int ret, int err,
		       struct rec *pre)
{
	unsigned char expect = kind;
	struct rec r;

	if (fd < 0 || fd >= FD_SLOTS || (ret < 0 && err == EBADF))
		return;
	atomic_compare_exchange_strong(&fd_kind[fd], &expect, FD_UNKNOWN);
	if (kind != FD_NV && kind != FD_UVM)
		return;
	if (!pre) {
		rec_init(&r, NVTRACE_CLOSE, fd);
		pre = &r;
	}
	pre->h.end_ns = now_ns(CLOCK_MONOTONIC);
	pre->h.ret = ret;
	pre->h.err = ret < 0 ? err : 0;
	emit(pre);
}

/* After a dup of old to fd (fd's previous file, if any, is closed). */
static void note_dup(int old, int fd, enum fd_kind replaced)
{
	char path[PATH_MAX];
	int saved = errno;

	if (fd < 0)
		return;
	note_close(fd, replaced, 0, 0, NULL);
	if (kind_of(old) != FD_OTHER && fd_path(fd, path, sizeof(path)) > 0)
		learn(fd, path, 0, 0, NVTRACE_OPEN_DUP, old);
	else if (fd < FD_SLOTS)
		atomic_store(&fd_kind[fd], FD_OTHER);
	errno = saved;
}

/* --- ioctl and mmap ------------------------------------------------------ */

/*
 * The buffer an RM_ALLOC or RM_CONTROL params block points to. The driver
 * reads a control's params by its paramsSize, but an allocation's by the
 * size its class takes, whatever paramsSize says (libcuda leaves it 0): a
 * window, up to the first unreadable page.
 */
static void add_nested(struct rec *r, uint32_t nr, const struct block *p)
{
	uint64_t ptr = 0;
	uint32_t len = 0;

	if (nr == ESC_RM_ALLOC && (whole(p, 32) || whole(p, 48))) {
		ptr = get_u64(p, 16);
		len = nvt.window;
	} else if (nr == ESC_RM_CONTROL && whole(p, 32)) {
		ptr = get_u64(p, 16);
		len = get_u32(p, 24);
	}
	if (ptr && len)
		add_block(r, NVTRACE_B_PTR, 0, ptr, len);
}

/* The blocks before the call: params, XFER payload, nested buffer. */
static void blocks_in(struct rec *r, enum fd_kind kind, unsigned long req,
		      void *argp)
{
	uint32_t size = kind == FD_UVM ? nvt.window : _IOC_SIZE(req);
	uint32_t nr = _IOC_NR(req);
	struct block *p;
	uint64_t ptr;

	if (!argp || !size)
		return;
	p = add_block(r, NVTRACE_B_ARG, 0, (uintptr_t)argp, size);
	if (kind == FD_UVM || _IOC_TYPE(req) != 'F' || !p)
		return;
	if (nr == ESC_XFER && whole(p, 16)) {
		nr = get_u32(p, 0);
		size = get_u32(p, 4);
		ptr = get_u64(p, 8);
		p = ptr && size ? add_block(r, NVTRACE_B_XFER, 0, ptr, size) : NULL;
	}
	if (p)
		add_nested(r, nr, p);
}

static void blocks_out(struct rec *r)
{
	int i, n = r->n;

	for (i = 0; i < n; i++)
		add_block(r, r->b[i].h.tag, NVTRACE_BF_OUT, r->b[i].h.addr,
			  r->b[i].h.want);
}

static int trace_ioctl(int fd, enum fd_kind kind, unsigned long req, void *argp)
{
	struct rec r;
	int ret, err;

	rec_init(&r, NVTRACE_IOCTL, fd);
	r.h.arg[0] = req;
	r.h.arg[1] = (uintptr_t)argp;
	blocks_in(&r, kind, req, argp);
	r.h.start_ns = now_ns(CLOCK_MONOTONIC);
	ret = real_ioctl(fd, req, argp);
	err = errno;
	r.h.end_ns = now_ns(CLOCK_MONOTONIC);
	r.h.ret = ret;
	r.h.err = ret < 0 ? err : 0;
	blocks_out(&r);
	emit(&r);
	free_blocks(&r);
	errno = err;
	return ret;
}

int ioctl(int fd, unsigned long req, ...)
{
	enum fd_kind kind;
	va_list ap;
	void *argp;

	va_start(ap, req);
	argp = va_arg(ap, void *);
	va_end(ap);
	RESOLVE(ioctl);
	kind = kind_of(fd);
	if (kind != FD_NV && kind != FD_UVM)
		return real_ioctl(fd, req, argp);
	return trace_ioctl(fd, kind, req, argp);
}

static void *trace_mmap(void *addr, size_t len, int prot, int flags, int fd,
			off64_t off, int large)
{
	struct rec r;
	void *ret;
	int err;

	rec_init(&r, NVTRACE_MMAP, fd);
	r.h.arg[0] = (uintptr_t)addr;
	r.h.arg[1] = len;
	r.h.arg[2] = (uint32_t)prot | (uint64_t)(uint32_t)flags << 32;
	r.h.arg[3] = (uint64_t)off;
	if (large)
		ret = real_mmap64(addr, len, prot, flags, fd, off);
	else
		ret = real_mmap(addr, len, prot, flags, fd, (off_t)off);
	err = errno;
	r.h.end_ns = now_ns(CLOCK_MONOTONIC);
	r.h.ret = (int64_t)(intptr_t)ret;
	r.h.err = ret == MAP_FAILED ? err : 0;
	emit(&r);
	errno = err;
	return ret;
}

void *mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off)
{
	RESOLVE(mmap);
	if (fd < 0 || (flags & MAP_ANONYMOUS) || kind_of(fd) == FD_OTHER)
		return real_mmap(addr, len, prot, flags, fd, off);
	return trace_mmap(addr, len, prot, flags, fd, off, 0);
}

void *mmap64(void *addr, size_t len, int prot, int flags, int fd, off64_t off)
{
	RESOLVE(mmap64);
	if (fd < 0 || (flags & MAP_ANONYMOUS) || kind_of(fd) == FD_OTHER)
		return real_mmap64(addr, len, prot, flags, fd, off);
	return trace_mmap(addr, len, prot, flags, fd, off, 1);
}

/* --- open, close, dup ---------------------------------------------------- */

#ifdef __OPEN_NEEDS_MODE
#define NEEDS_MODE(flags) __OPEN_NEEDS_MODE(flags)
#else
#define NEEDS_MODE(flags) ((flags) & O_CREAT)
#endif

#define MODE_ARG(flags, mode) do {					\
	va_list ap;							\
	if (NEEDS_MODE(flags)) {					\
		va_start(ap, flags);					\
		mode = va_arg(ap, mode_t);				\
		va_end(ap);						\
	}								\
} while (0)

int open(const char *path, int flags, ...)
{
	mode_t mode = 0;
	int fd;

	MODE_ARG(flags, mode);
	RESOLVE(open);
	fd = real_open(path, flags, mode);
	note_open(fd, path, flags, mode);
	return fd;
}

int open64(const char *path, int flags, ...)
{
	mode_t mode = 0;
	int fd;

	MODE_ARG(flags, mode);
	RESOLVE(open64);
	fd = real_open64(path, flags, mode);
	note_open(fd, path, flags, mode);
	return fd;
}

int openat(int dirfd, const char *path, int flags, ...)
{
	mode_t mode = 0;
	int fd;

	MODE_ARG(flags, mode);
	RESOLVE(openat);
	fd = real_openat(dirfd, path, flags, mode);
	note_open(fd, path, flags, mode);
	return fd;
}

int openat64(int dirfd, const char *path, int flags, ...)
{
	mode_t mode = 0;
	int fd;

	MODE_ARG(flags, mode);
	RESOLVE(openat64);
	fd = real_openat64(dirfd, path, flags, mode);
	note_open(fd, path, flags, mode);
	return fd;
}

/* The _FORTIFY_SOURCE entry points. */
int __open_2(const char *path, int flags)
{
	int fd;

	RESOLVE(__open_2);
	fd = real___open_2(path, flags);
	note_open(fd, path, flags, 0);
	return fd;
}

int __open64_2(const char *path, int flags)
{
	int fd;

	RESOLVE(__open64_2);
	fd = real___open64_2(path, flags);
	note_open(fd, path, flags, 0);
	return fd;
}

int __openat_2(int dirfd, const char *path, int flags)
{
	int fd;

	RESOLVE(__openat_2);
	fd = real___openat_2(dirfd, path, flags);
	note_open(fd, path, flags, 0);
	return fd;
}

int __openat64_2(int dirfd, const char *path, int flags)
{
	int fd;

	RESOLVE(__openat64_2);
	fd = real___openat64_2(dirfd, path, flags);
	note_open(fd, path, flags, 0);
	return fd;
}

static enum fd_kind known_kind(int fd)
{
	return fd >= 0 && fd < FD_SLOTS ? atomic_load(&fd_kind[fd]) : FD_OTHER;
}

int close(int fd)
{
	enum fd_kind kind = known_kind(fd);
	struct rec r;
	int ret, err;

	RESOLVE(close);
	lose_out(fd);
	if (kind == FD_NV || kind == FD_UVM)
		rec_init(&r, NVTRACE_CLOSE, fd);
	ret = real_close(fd);
	err = errno;
	note_close(fd, kind, ret, err, &r);
	errno = err;
	return ret;
}

int dup(int old)
{
	int fd;

	RESOLVE(dup);
	fd = real_dup(old);
	note_dup(old, fd, FD_UNKNOWN);
	return fd;
}

int dup2(int old, int new)
{
	enum fd_kind replaced = known_kind(new);
	int fd;

	RESOLVE(dup2);
	if (old != new)
		lose_out(new);
	fd = real_dup2(old, new);
	if (old != new)
		note_dup(old, fd, replaced);
	return fd;
}

int dup3(int old, int new, int flags)
{
	enum fd_kind replaced = known_kind(new);
	int fd;

	RESOLVE(dup3);
	lose_out(new);
	fd = real_dup3(old, new, flags);
	note_dup(old, fd, replaced);
	return fd;
}

#if defined(__GLIBC__) && __GLIBC_PREREQ(2, 34)
static int (*real_close_range)(unsigned int, unsigned int, int);

int close_range(unsigned int first, unsigned int last, int flags)
{
	unsigned int fd, end = last < FD_SLOTS ? last : FD_SLOTS - 1;
	int ret, err;

	RESOLVE(close_range);
	if (!(flags & CLOSE_RANGE_CLOEXEC))
		for (fd = first; fd <= end && fd >= first; fd++)
			lose_out((int)fd);
	ret = real_close_range(first, last, flags);
	err = errno;
	if (!ret && !(flags & CLOSE_RANGE_CLOEXEC))
		for (fd = first; fd <= end && fd >= first; fd++)
			note_close((int)fd, known_kind((int)fd), 0, 0,
				   NULL);
	errno = err;
	return ret;
}
#endif
