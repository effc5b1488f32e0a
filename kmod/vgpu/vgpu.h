/* SPDX-License-Identifier: GPL-2.0 */
/*
 * vgpu: emulated NVIDIA device files that forward to a backing driver and
 * route selected calls to the vgpud daemon. Internal declarations.
 */
#ifndef _VGPU_H
#define _VGPU_H

#include <linux/types.h>
#include <linux/atomic.h>
#include <linux/percpu.h>
#include <linux/fs.h>
#include <linux/mutex.h>
#include <linux/path.h>
#include <linux/rcupdate.h>
#include <linux/bitmap.h>
#include <linux/bits.h>
#include <linux/wait.h>
#include <nvidia/nv_ioctl.h>
#include <uapi/linux/vgpu.h>

struct net;
struct sk_buff;
struct vgpu_opener_slots;
struct vgpu_shadow;
struct vgpu_upcall_msg;

#define VGPU_NODE_KINDS		3
#define VGPU_MAX_GPUS		248	/* nvidia0..nvidia247, as NVIDIA */
#define VGPU_MINOR_UVM		254
#define VGPU_MINOR_CTL		255
#define VGPU_MINORS		256

/* Module parameters (main.c). */
extern char *vgpu_backing_dir;
extern char *vgpu_backing_driver;
extern char *vgpu_backing_uvm_driver;
extern unsigned int vgpu_upcall_timeout_ms;
extern bool vgpu_fail_open;
extern unsigned int vgpu_upcalls_per_ctx;
extern unsigned int vgpu_upcalls_per_opener;
extern unsigned int vgpu_upcalls_max;

/*
 * Counters behind struct vgpu_stats, per CPU so that the fast path pays no
 * atomic instruction; GET_STATS sums them. @contexts goes up and down, so
 * one CPU's share may wrap; the sum does not.
 */
struct vgpu_counters {
	u64 contexts;
	u64 opens;
	u64 ioctls;
	u64 upcalls;
	u64 verdicts;
	u64 timeouts;
	u64 lost;
	u64 fail_open;
	u64 fail_closed;
	u64 killed;
	u64 events;
	u64 events_lost;
	u64 bad_verdicts;
	u64 mmaps;
};

/* Counters behind struct vgpu_stats4, from @abandoned on, in its order. */
struct vgpu_counters4 {
	u64 abandoned;
	u64 revoked;
	u64 tampered;
	u64 throttled;
	u64 proxies;
	u64 objects;
};

DECLARE_PER_CPU(struct vgpu_counters, vgpu_counters);
DECLARE_PER_CPU(struct vgpu_counters4, vgpu_counters4);

#define vgpu_count(field)	this_cpu_inc(vgpu_counters.field)
#define vgpu_uncount(field)	this_cpu_dec(vgpu_counters.field)
#define vgpu_count4(field)	this_cpu_inc(vgpu_counters4.field)

/**
 * struct vgpu_node_dev - one emulated device file, fixed from load to unload
 * @kind: enum vgpu_node
 * @index: GPU index for VGPU_NODE_GPU, else 0
 * @name: its name, the backing node's too (nvidiactl, nvidiaN, nvidia-uvm)
 * @driver: the module that must own the backing file's f_op
 * @path: the backing driver's node, resolved once at load in the loader's
 *	namespace; one reference held until unload
 * @dev: our device (class device, devtmpfs node vgpu/<name>)
 */
struct vgpu_node_dev {
	u32 kind;
	u32 index;
	char name[16];
	const char *driver;
	struct path path;
	struct device *dev;
};

/**
 * struct vgpu_shadow_cache - a context's shadow region, kept between calls
 * @lock: held by the one call using the region, from its map to its unmap
 *	(shadow.c); other calls meanwhile map a region of their own
 * @mm: the mm the region lies in, grabbed (mm_count) so that the pointer
 *	names that mm as long as it is kept; NULL when there is none
 * @base: where the region starts in @mm
 * @file: the region's file (shadow.c), one reference
 *
 * @mm, @base and @file are written under @lock, and at release, when no
 * call is in flight.
 */
struct vgpu_shadow_cache {
	struct mutex lock;	/* protects mm, base, file; held by the user */
	struct mm_struct *mm;
	unsigned long base;
	struct file *file;
};

/**
 * struct vgpu_ctx - one open emulated file (file->private_data)
 * @id: unique while the module lives
 * @node: the emulated node it was opened on
 * @backing: the backing driver's file, one reference held
 * @cgroup_id: cgroup v2 id of the opener
 * @pid: opener's thread id (init pid namespace)
 * @tgid: opener's process id
 * @uid: opener's fsuid (init user namespace)
 * @gid: opener's fsgid
 * @start_boottime: start time of the opener's process (its thread-group
 *	leader's start_boottime, ns): a pid binding names this process only
 * @shadow: the region its shadow calls reuse (shadow.c)
 * @revoked: a shadow was unmapped during one of its calls, so the driver
 *	may have read what the caller put at its address: every later call
 *	fails (-EIO). Set once, WRITE_ONCE/READ_ONCE, no lock
 * @slots: the upcall slots of its opener (uid and cgroup), shared by the
 *	opener's contexts; one reference held from open to release
 * @inflight: its upcalls in flight, at most upcalls_per_ctx; under
 *	vgpu_slots.lock (upcall.c)
 * @slot_wait: its callers waiting for one of its upcall slots
 * @rcu: for kfree_rcu: registry readers may still hold it (ctxreg.c)
 *
 * Immutable after open, but for @shadow (its own lock), @revoked and @inflight
 * (vgpu_slots.lock); in the context registry from open to release; freed
 * by release, after an RCU grace period.
 */
struct vgpu_ctx {
	u64 id;
	const struct vgpu_node_dev *node;
	struct file *backing;
	u64 cgroup_id;
	u32 pid;
	u32 tgid;
	u32 uid;
	u32 gid;
	u64 start_boottime;
	struct vgpu_shadow_cache shadow;
	bool revoked;
	struct vgpu_opener_slots *slots;
	u32 inflight;
	wait_queue_head_t slot_wait;
	struct rcu_head rcu;
};

/* chardev.c */
/**
 * struct vgpu_call - one ioctl, after IOCTL_XFER_CMD unwrapping
 * @cmd: the command word as issued
 * @node: enum vgpu_node
 * @nr: escape number (UVM: the command)
 * @size: params size (UVM: 0, unknown)
 * @flags: VGPU_UPCALL_F_*
 * @xfer: an IOCTL_XFER_CMD call: the wrapper as the module read it, which
 *	the driver is given instead of the caller's (see vgpu_forward()); NULL
 *	for any other call
 * @params: the caller's params (the inner ones for XFER)
 * @arg: the ioctl argument as issued
 */
struct vgpu_call {
	u32 cmd;
	u32 node;
	u32 nr;
	u32 size;
	u32 flags;
	const struct nv_ioctl_xfer *xfer;
	void __user *params;
	unsigned long arg;
};

extern const struct file_operations vgpu_fops;
long vgpu_forward(struct vgpu_ctx *ctx, const struct vgpu_call *c,
		  struct vgpu_shadow *sh);
void vgpu_msg_init(struct vgpu_upcall_msg *m, struct vgpu_ctx *ctx, u32 kind);
int vgpu_chardev_init(void);
void vgpu_chardev_exit(void);

/* slowpath.c: a call some rule may select; @key: what selected its rule. */
long vgpu_ioctl_slow(struct vgpu_ctx *ctx, const struct vgpu_call *c,
		     u32 copy_size, u32 *key);

/* ctxreg.c: the live contexts by id; its lock and RCU rules are there. */
int vgpu_ctx_register(struct vgpu_ctx *ctx);
void vgpu_ctx_unregister(struct vgpu_ctx *ctx);
struct file *vgpu_ctx_backing_get(u64 id, u32 *node);
u32 vgpu_ctx_list(u64 start, struct vgpu_context *out,
		  struct vgpu_opener *openers, u32 max, u64 *next);

/* rmcall.c: the module's own RM calls, for sched.c and object.c */
#define VGPU_RM_CONTROL	_IOC(_IOC_READ | _IOC_WRITE, NV_IOCTL_MAGIC, \
			     NV_ESC_RM_CONTROL, sizeof(struct nvos54))
#define VGPU_RM_FREE	_IOC(_IOC_READ | _IOC_WRITE, NV_IOCTL_MAGIC, \
			     NV_ESC_RM_FREE, sizeof(struct nvos00))
int vgpu_rm_call(struct file *backing, unsigned int cmd, unsigned long ubuf,
		 void *blk, size_t len);
unsigned long vgpu_rm_page_map(const char **why);
void vgpu_rm_page_unmap(unsigned long ubuf);
struct file *vgpu_rm_backing(u64 ctx_id, int *err);

/* sched.c */
int vgpu_schedule(const struct vgpu_sched *in, u32 n,
		  struct vgpu_sched_result *out, const char **why);
bool vgpu_sched_alloc_layout(u32 nr, u32 size);
void vgpu_sched_new_group(struct vgpu_ctx *ctx, const struct nvos21 *checked,
			  const struct nvos21 *results);
u32 vgpu_sched_restore(void);
void vgpu_sched_forget(u64 ctx_id);
void vgpu_sched_exit(void);

/* object.c */
int vgpu_object(const struct vgpu_obj_op *in, u32 n,
		struct vgpu_obj_result *out, const char **why);
u64 vgpu_objects_run(void);

/* fdxlate.c */
/**
 * struct vgpu_fdx - one fd argument translated for the duration of a call
 * @ours: our emulated file the caller named (referenced), NULL: none
 * @proxy: the proxy installed at @tmp_fd (referenced), NULL: none
 * @uptr: where the fd lies in the params, NULL: nothing translated
 * @kptr: where it lies in the shadow's kernel view, NULL: @uptr is read
 * @orig_fd: the caller's fd number, restored after the call
 * @tmp_fd: the temporary fd of the proxy
 *
 * Owned by one call, on its stack.
 */
struct vgpu_fdx {
	struct file *ours;
	struct file *proxy;
	int __user *uptr;
	int *kptr;
	int orig_fd;
	int tmp_fd;
};

int vgpu_fdx_prepare(struct vgpu_fdx *x, u32 node, u32 nr, u32 size,
		     void __user *params, void *kparams);
void vgpu_fdx_finish(struct vgpu_fdx *x);
void vgpu_fdx_mark(unsigned long *map, u32 node);
struct file *vgpu_pseudo_file(const char *name,
			      const struct file_operations *fops, void *priv);
int vgpu_fdx_init(void);
void vgpu_fdx_exit(void);

/* shadow.c */
/**
 * struct vgpu_shadow - a call's checked blocks, mapped in the caller's mm
 * @cache: the context's kept region, held by this call (its lock), or NULL
 *	for a region of the call's own
 * @file: the region's file (the cache's, or one reference of the call's own)
 * @base: start of the region; 0 when nothing is mapped
 * @len: its length, whole pages
 * @arg: the ioctl argument that names the shadow (its wrapper or params)
 * @params: the shadow params, or NULL (a wrapper only)
 * @data: the shadow copy of the rule's buffer, or NULL
 * @list: the shadow copy of the buffer's nested list, or NULL
 * @kparams: @params as the module reads and writes them (the region's
 *	kernel mapping), or NULL
 * @kdata: @data so, or NULL
 * @klist: @list so, or NULL
 *
 * Owned by one call, on its stack; never shared.
 */
struct vgpu_shadow {
	struct vgpu_shadow_cache *cache;
	struct file *file;
	unsigned long base;
	size_t len;
	unsigned long arg;
	void __user *params;
	void __user *data;
	void __user *list;
	void *kparams;
	void *kdata;
	void *klist;
};

/**
 * struct vgpu_shadow_list - a nested list to shadow with a rule's buffer
 * @ptr_off: offset of the list's u64 pointer in the buffer
 * @list: the list as the upcall carried it
 * @len: its length, 1..VGPU_PARAMS_MAX
 */
struct vgpu_shadow_list {
	u32 ptr_off;
	const void *list;
	u32 len;
};

int vgpu_shadow_map(struct vgpu_shadow *sh, struct vgpu_ctx *ctx,
		    const struct nv_ioctl_xfer *xfer,
		    const void *params, u32 plen, u32 ptr_off,
		    const void *data, u32 dlen,
		    const struct vgpu_shadow_list *list);
int vgpu_shadow_map_wrapper(struct vgpu_shadow *sh, struct vgpu_ctx *ctx,
			    const struct nv_ioctl_xfer *xfer);
void vgpu_shadow_release(struct vgpu_ctx *ctx);
void vgpu_shadow_enter(struct vgpu_shadow *sh);
bool vgpu_shadow_leave(struct vgpu_shadow *sh);
void vgpu_shadow_unmap(struct vgpu_shadow *sh);

/* upcall.c */

/* Outcome of vgpu_upcall(). */
enum vgpu_outcome {
	VGPU_OUT_VERDICT,	/* the daemon answered, see the verdict */
	VGPU_OUT_FORWARD,	/* no answer; fail-open says forward */
};

/* What a REPLY verdict filled, struct vgpu_upcall_msg.replied */
#define VGPU_REPLIED_PARAMS	BIT(0)
#define VGPU_REPLIED_DATA	BIT(1)
#define VGPU_REPLIED_DATA2	BIT(2)

/**
 * struct vgpu_upcall_msg - one upcall as its sender builds it
 * @ctx: the context it is made for, whose upcall slots it takes
 * @hdr: the header; @hdr.id 0 asks vgpu_upcall() for a new id
 * @params: the params block sent, or NULL
 * @params_len: its length
 * @data: the rule's buffer sent, or NULL
 * @data_len: its length
 * @data2: the nested list sent (VGPU_A_DATA2), or NULL
 * @data2_len: its length
 * @cgroup: OPEN: the opener's cgroup path, or NULL
 * @opener: OPEN: more of the opener (VGPU_A_OPENER), or NULL
 * @reply_params: NULL, or @params_len bytes that a REPLY fills
 * @reply_data: NULL, or @data_len bytes that a REPLY fills
 * @reply_data2: NULL, or @data2_len bytes that a REPLY fills
 * @replied: out: VGPU_REPLIED_* of the verdict returned
 */
struct vgpu_upcall_msg {
	struct vgpu_ctx *ctx;
	struct vgpu_upcall hdr;
	const void *params;
	u32 params_len;
	const void *data;
	u32 data_len;
	const void *data2;
	u32 data2_len;
	const char *cgroup;
	const struct vgpu_opener *opener;
	void *reply_params;
	void *reply_data;
	void *reply_data2;
	u32 replied;
};

/**
 * struct vgpu_blocks - the blocks a REPLY verdict carries (netlink payload)
 * @params: VGPU_A_PARAMS, or NULL
 * @params_len: its length
 * @data: VGPU_A_DATA, or NULL
 * @data_len: its length
 * @data2: VGPU_A_DATA2, or NULL
 * @data2_len: its length
 */
struct vgpu_blocks {
	const void *params;
	u32 params_len;
	const void *data;
	u32 data_len;
	const void *data2;
	u32 data2_len;
};

int vgpu_upcall(struct vgpu_upcall_msg *msg, struct vgpu_verdict *v);
int vgpu_slots_attach(struct vgpu_ctx *ctx);
void vgpu_slots_detach(struct vgpu_ctx *ctx);
int vgpu_verdict(struct net *net, u32 portid, const struct vgpu_verdict *v,
		 const struct vgpu_blocks *b, const char **why);
void vgpu_event(const struct vgpu_event *ev, const void *params, u32 plen,
		const void *data, u32 dlen);
int vgpu_daemon_register(struct net *net, u32 portid, bool *fresh);
int vgpu_daemon_unregister(struct net *net, u32 portid);
void vgpu_daemon_gone(struct net *net, u32 portid);
bool vgpu_daemon_is(struct net *net, u32 portid);
u32 vgpu_daemon_portid(void);
void vgpu_upcall_exit(void);

/* filter.c */
extern unsigned long vgpu_hot[VGPU_NODE_KINDS][BITS_TO_LONGS(256)];

/* Does a call with this escape need more than a plain forward? */
static inline bool vgpu_nr_hot(u32 node, u32 nr)
{
	return test_bit(nr & 0xff, vgpu_hot[node]);
}

void vgpu_filter_init(void);
int vgpu_filter_set(u32 flags, const void *rules, u32 n_rules,
		    const void *nested, u32 n_nested, const char **why);
bool vgpu_filter_wants(u32 flag);
bool vgpu_filter_candidates(u32 node, u32 nr, u32 *size);
bool vgpu_filter_match(u32 node, u32 nr, u32 size, const void *params,
		       struct vgpu_rule *out, struct vgpu_rule_nested *nested,
		       u32 *eff);
void vgpu_filter_exit(void);

/* genl.c */
int vgpu_genl_init(void);
void vgpu_genl_exit(void);
struct sk_buff *vgpu_genl_upcall_skb(const struct vgpu_upcall_msg *msg);
struct sk_buff *vgpu_genl_event_skb(const struct vgpu_event *ev,
				    const void *params, u32 plen,
				    const void *data, u32 dlen);
int vgpu_genl_send(struct net *net, u32 portid, struct sk_buff *skb);

#endif /* _VGPU_H */
