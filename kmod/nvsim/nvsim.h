/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * nvsim: a simulated NVIDIA driver for tests.  Internal declarations.
 *
 * Locking
 *   nvsim_lock (objects.c) is one mutex for all RM state: the client table,
 *   every object tree, GPU memory usage, per-file object counts, the
 *   register link and the mmap context of each file.  It is never held
 *   across copy_from_user/copy_to_user of caller memory, so a page fault on
 *   an nvsim mapping inside a copy never waits for it.
 *   A backing store (mmap.c) has no lock of its own: its pages live in an
 *   xarray filled with xa_cmpxchg from the fault handler, and its lifetime
 *   is a kref held by the memory object, by mmap contexts and by VMAs.
 *   Each GPU's work engine (engine.c) has a spinlock for its run queue and
 *   the engine state of its channel groups (struct nvsim_group); it nests
 *   inside nvsim_lock and is the only lock its kthread takes.
 */
#ifndef NVSIM_H
#define NVSIM_H

#include <linux/fs.h>
#include <linux/kref.h>
#include <linux/ktime.h>
#include <linux/list.h>
#include <linux/mutex.h>
#include <linux/types.h>
#include <linux/xarray.h>

#include <nvidia/nv_ioctl.h>
#include <nvidia/nv_rm.h>
#include <nvidia/nv_status.h>

#define NVSIM_MAX_GPUS		8
#define NVSIM_MINOR_UVM		254
#define NVSIM_MINOR_CTL		255
#define NVSIM_MINORS		256

/* Bound on objects (clients, objects, CPU mappings) per ctl file. */
#define NVSIM_MAX_OBJECTS	4096
/* Bound on clients of all files (well below the client handle range). */
#define NVSIM_MAX_CLIENTS	65536

#define NVSIM_VERSION_STRING	"595.45.04"
#define NVSIM_PCI_VENDOR	0x10de
#define NVSIM_PCI_DEVICE	0x2330

/*
 * nvsim-private (not NVIDIA's): simulated work on a channel group.
 * NVSIM_ESC_SUBMIT_WORK on nvidiactl queues work_ns of GPU time on
 * hChannelGroup; GET_WORK_STATS (on a channel group) reads its counters.
 */
#define NVSIM_ESC_SUBMIT_WORK			0xf0
#define NVSIM_CTRL_CMD_GET_WORK_STATS		0xa06c01f0

struct nvsim_submit_work {
	u32 h_client;
	u32 h_channel_group;
	u64 work_ns;
	u32 status;
	u32 reserved;
};

struct nvsim_work_stats_params {
	u64 busy_ns;
	u64 pending_ns;
	u32 b_enabled;
	u32 timeslice_us;
};

struct nvsim_gpu {
	unsigned int index;
	u64 capacity;		/* bytes */
	u64 used;		/* bytes charged; nvsim_lock */
	u64 next_fb;		/* bump allocator for FB offsets; nvsim_lock */
};

extern struct nvsim_gpu nvsim_gpus[NVSIM_MAX_GPUS];
extern unsigned int nvsim_ngpus;
extern struct mutex nvsim_lock;

static inline u32 nvsim_gpu_id(const struct nvsim_gpu *gpu)
{
	return (gpu->index + 1) << 8;
}

/* Base of a GPU's simulated BAR1: RM_MAP_MEMORY returns addresses in it. */
static inline u64 nvsim_bar1_base(const struct nvsim_gpu *gpu)
{
	return (u64)(0x2000 + gpu->index) << 32;
}

enum nvsim_file_kind {
	NVSIM_FILE_GPU,
	NVSIM_FILE_CTL,
	NVSIM_FILE_UVM,
};

struct nvsim_store;

/* A validated RM_MAP_MEMORY waiting for (or serving) mmap on a GPU file. */
struct nvsim_mapctx {
	struct nvsim_store *store;	/* counted reference */
	pgoff_t first_page;		/* in the store */
	pgoff_t npages;
};

struct nvsim_file {
	enum nvsim_file_kind kind;
	struct nvsim_gpu *gpu;		/* GPU files only */
	struct list_head clients;	/* clients owned; nvsim_lock */
	unsigned int nobjs;		/* objects charged here; nvsim_lock */
	struct file *ctl_file;		/* REGISTER_FD target, held; nvsim_lock */
	struct nvsim_mapctx *mapctx;	/* one per file, like nvlfp; nvsim_lock */
	bool attached;			/* ATTACH_GPUS_TO_FD done; nvsim_lock */
	bool uvm_initialized;		/* nvsim_lock */
	u64 uvm_flags;
	pid_t tgid;			/* the opener */
};

enum nvsim_obj_kind {
	NVSIM_OBJ_CLIENT,
	NVSIM_OBJ_DEVICE,
	NVSIM_OBJ_SUBDEVICE,
	NVSIM_OBJ_MEMORY,	/* charged local memory, or system memory */
	NVSIM_OBJ_VIRTUAL,	/* address space only */
	NVSIM_OBJ_VASPACE,
	NVSIM_OBJ_TSG,
};

struct nvsim_client;
struct nvsim_engine;

/*
 * A channel group's engine state.  The handles and tgid are fixed when it
 * is added; the rest is under its engine's lock (engine.c).
 */
struct nvsim_group {
	struct nvsim_engine *eng;
	struct list_head node;		/* on the engine's run queue */
	u32 hclient;
	u32 hgroup;
	pid_t tgid;			/* opener of the owning nvidiactl */
	bool enabled;			/* GPFIFO_SCHEDULE */
	u64 timeslice_us;		/* SET_TIMESLICE */
	u32 level;			/* SET_INTERLEAVE_LEVEL */
	u64 high_block;			/* HIGH: the block it last ran in */
	u64 pending_ns;			/* work submitted, not yet run */
	u64 busy_ns;			/* work run */
	u64 wait_ns;			/* off (GPFIFO_SCHEDULE) with pending work */
	u64 debt_ns;			/* slice overrun owed */
	u64 preempts;			/* taken off the engine by PREEMPT */
	u64 ready_ns;			/* on, with pending work, not running */
	ktime_t wake_at;		/* work came to a group with none pending */
	bool waking;			/* wake_at set, first engine time to come */
	u64 wake_sum_ns;		/* submit-to-run latencies */
	u64 wake_n;
	u64 wake_max_ns;
};

/*
 * The memory behind one memory object and its duplicates (RM_DUP_OBJECT);
 * all fields under nvsim_lock.  Capacity is charged once, by the first
 * handle, and returned when the last handle is freed.
 */
struct nvsim_mem {
	unsigned int refs;		/* handles that refer to it */
	struct nvsim_gpu *gpu;
	u64 size;			/* rounded to its granule */
	u64 page_size;			/* chosen from attr/attr2 */
	u64 fb_offset;
	bool charged;
	struct nvsim_store *store;	/* lazily, counted */
};

/* An RM object; all fields under nvsim_lock. */
struct nvsim_obj {
	u32 handle;
	u32 hclass;
	enum nvsim_obj_kind kind;
	struct nvsim_client *client;
	struct nvsim_obj *parent;	/* NULL for the client itself */
	struct list_head children;
	struct list_head sibling;
	struct nvsim_gpu *gpu;		/* device and below */
	union {
		struct {
			struct nvsim_mem *m;	/* shared by duplicates */
			struct list_head cpumaps;
		} mem;
		struct nvsim_group tsg;
	};
};

/* An RM CPU mapping record, found again by RM_UNMAP_MEMORY. */
struct nvsim_cpumap {
	struct list_head node;
	u64 address;
};

struct nvsim_client {
	struct nvsim_obj root;
	struct xarray objects;		/* handle -> nvsim_obj */
	struct nvsim_file *owner;
	struct list_head owner_node;
	pid_t tgid;
	u32 next_handle;
};

/* main.c */
struct file *nvsim_file_get(int fd, bool ctl, struct nvsim_file **nfp);
void nvsim_count_rm_call(void);

/* ioctl.c */
long nvsim_ioctl(struct file *file, unsigned int cmd, unsigned long arg);

/* objects.c */
int nvsim_rm_alloc(struct nvsim_file *nf, void *buf, u32 size);
int nvsim_rm_free(struct nvsim_file *nf, struct nvos00 *p);
int nvsim_rm_control(struct nvsim_file *nf, struct nvos54 *p);
int nvsim_rm_alloc_memory(struct nvsim_file *nf, struct nvos02_with_fd *p);
int nvsim_rm_vid_heap(struct nvsim_file *nf, struct nvos32 *p);
int nvsim_rm_map_memory(struct nvsim_file *nf, struct nvos33_with_fd *p);
int nvsim_rm_unmap_memory(struct nvsim_file *nf, struct nvos34 *p);
int nvsim_rm_dup_object(struct nvsim_file *nf, struct nvos55 *p);
int nvsim_submit_work(struct nvsim_file *nf, struct nvsim_submit_work *p);
void nvsim_file_free_clients(struct nvsim_file *nf);

/* engine.c */
int nvsim_engine_init(void);
void nvsim_engine_exit(void);
void nvsim_group_add(struct nvsim_group *g, const struct nvsim_gpu *gpu,
		     u32 hclient, u32 hgroup, pid_t tgid);
void nvsim_group_remove(struct nvsim_group *g);
void nvsim_group_set_enabled(struct nvsim_group *g, bool enabled);
u32 nvsim_group_set_timeslice(struct nvsim_group *g, u64 us);
u32 nvsim_group_preempt(struct nvsim_group *g,
			const struct nva06c_preempt_params *p);
u64 nvsim_group_timeslice(struct nvsim_group *g);
u32 nvsim_group_submit(struct nvsim_group *g, u64 ns);
u32 nvsim_group_set_level(struct nvsim_group *g, u32 level);
void nvsim_group_stats(struct nvsim_group *g, struct nvsim_work_stats_params *p);

/* mmap.c */
int nvsim_store_init(void);
void nvsim_store_exit(void);
struct nvsim_store *nvsim_store_create(pgoff_t npages);
void nvsim_store_get(struct nvsim_store *store);
void nvsim_store_put(struct nvsim_store *store);
void nvsim_mapctx_free(struct nvsim_mapctx *ctx);
int nvsim_mmap(struct file *file, struct vm_area_struct *vma);

#endif /* NVSIM_H */
