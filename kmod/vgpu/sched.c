// SPDX-License-Identifier: GPL-2.0
/*
 * SCHEDULE: turn channel groups on and off, set their timeslices and
 * preempt them, through their owners' files.
 *
 * Each entry becomes one RM_CONTROL issued on the backing file of the
 * context that owns the RM client, as if the owner had called it:
 * NVA06C_CTRL_CMD_GPFIFO_SCHEDULE (ON, OFF, OWNER_OFF), SET_TIMESLICE
 * (TIMESLICE), PREEMPT (PREEMPT, bWait 0: the driver preempts and
 * returns) or SET_INTERLEAVE_LEVEL (INTERLEAVE), through the module's own
 * RM call (rmcall.c). The driver reads NVOS54 and its params from the
 * current process's user memory, and the generic netlink handler runs in
 * the sender's (the daemon's) process: the blocks live in a small private
 * anonymous mapping of the daemon's mm, made once per message. The daemon's
 * own threads could write into it during the call; the daemon is trusted
 * (CAP_NET_ADMIN and the registered port), and the results it would spoil
 * are its own.
 *
 * The module remembers the groups it has turned off (until they are turned
 * on, or their context closes), so that a daemon that dies without turning
 * them back on does not leave their owners stalled: the next daemon to
 * register gets them turned on again, in its own process, before it
 * decides anything (vgpu_sched_restore).
 *
 * A group freed while off (by RM_FREE of itself, its device or its client)
 * leaves its record behind: the module does not see the object tree. So
 * the table is bounded (sched_off_max) and swept when full: each record's
 * "off" is issued again in the daemon's process, and the records whose
 * group or context is gone are dropped (vgpu_sched_sweep). What stays is
 * at most the groups that exist and are off, so a tenant that allocates
 * and frees groups cannot fill the table for the others.
 */
#include <linux/build_bug.h>
#include <linux/file.h>
#include <linux/fs.h>
#include <linux/hashtable.h>
#include <linux/ioctl.h>
#include <linux/list.h>
#include <linux/mm.h>
#include <linux/mman.h>
#include <linux/moduleparam.h>
#include <linux/mutex.h>
#include <linux/slab.h>
#include <linux/sched.h>
#include <linux/sched/signal.h>
#include <linux/stddef.h>
#include <linux/string.h>
#include <linux/timekeeping.h>

#include <nvidia/nv_rm.h>
#include <nvidia/nv_status.h>

#include "vgpu.h"
#include "trace.h"

/* What the daemon's mapping holds during one call. */
struct vgpu_sched_block {
	struct nvos54 ctl;
	union {
		struct nva06c_gpfifo_schedule_params sched;
		struct nva06c_timeslice_params ts;
		struct nva06c_preempt_params preempt;
		struct nva06c_interleave_level_params level;
	} params;
};

/*
 * Most groups remembered as off; past it the table is swept, and an "off"
 * entry that still finds no room gets -ENOSPC. Read when an entry is added.
 */
static unsigned int vgpu_sched_off_max = 65536;
module_param_named(sched_off_max, vgpu_sched_off_max, uint, 0644);
MODULE_PARM_DESC(sched_off_max, "Most channel groups remembered as turned off (default 65536)");

/**
 * struct vgpu_sched_off - a channel group this module turned off
 * @node: in vgpu_sched_offs, by vgpu_sched_key()
 * @ctx_id: the owner's context
 * @h_client: the RM client
 * @h_object: the channel group
 */
struct vgpu_sched_off {
	struct hlist_node node;
	u64 ctx_id;
	u32 h_client;
	u32 h_object;
};

/* vgpu_sched_off_lock protects vgpu_sched_offs and vgpu_sched_n_off. */
static DEFINE_MUTEX(vgpu_sched_off_lock);
static DEFINE_HASHTABLE(vgpu_sched_offs, 10);
static u32 vgpu_sched_n_off;

/*
 * vgpu_sched_lock serializes the daemon's changes of groups' state: whole
 * SCHEDULE messages, the restore at registration and the sweep. So a sweep
 * never issues an "off" between an "on" of the same group and the drop of
 * its record. Taken before vgpu_sched_off_lock.
 */
static DEFINE_MUTEX(vgpu_sched_lock);

static int vgpu_sched_n_off_get(char *buf, const struct kernel_param *kp)
{
	u32 n;

	mutex_lock(&vgpu_sched_off_lock);
	n = vgpu_sched_n_off;
	mutex_unlock(&vgpu_sched_off_lock);
	return sysfs_emit(buf, "%u\n", n);
}

static const struct kernel_param_ops vgpu_sched_n_off_ops = {
	.get = vgpu_sched_n_off_get,
};

module_param_cb(sched_offs, &vgpu_sched_n_off_ops, NULL, 0444);
MODULE_PARM_DESC(sched_offs, "channel groups remembered as turned off now (read-only)");

/*
 * One entry's control through @backing; the blocks go to user @ubuf. The
 * entry was checked (vgpu_sched_check): its op is known.
 */
static void vgpu_sched_one(struct file *backing, const struct vgpu_sched *s,
			   unsigned long ubuf, struct vgpu_sched_result *r)
{
	struct vgpu_sched_block blk;

	memset(&blk, 0, sizeof(blk));	/* padding included */
	blk.ctl.h_client = s->h_client;
	blk.ctl.h_object = s->h_object;
	blk.ctl.params = ubuf + offsetof(struct vgpu_sched_block, params);
	switch (s->enable) {
	case VGPU_SCHED_TIMESLICE:
		blk.ctl.cmd = NVA06C_CTRL_CMD_SET_TIMESLICE;
		blk.ctl.params_size = sizeof(blk.params.ts);
		blk.params.ts.timeslice_us = s->arg;
		break;
	case VGPU_SCHED_PREEMPT:
		blk.ctl.cmd = NVA06C_CTRL_CMD_PREEMPT;
		blk.ctl.params_size = sizeof(blk.params.preempt);
		break;
	case VGPU_SCHED_INTERLEAVE:
		blk.ctl.cmd = NVA06C_CTRL_CMD_SET_INTERLEAVE_LEVEL;
		blk.ctl.params_size = sizeof(blk.params.level);
		blk.params.level.tsg_interleave_level = s->arg;
		break;
	default:
		blk.ctl.cmd = NVA06C_CTRL_CMD_GPFIFO_SCHEDULE;
		blk.ctl.params_size = sizeof(blk.params.sched);
		blk.params.sched.b_enable = s->enable == VGPU_SCHED_ON;
		break;
	}
	r->error = vgpu_rm_call(backing, VGPU_RM_CONTROL, ubuf, &blk,
				sizeof(blk));
	if (!r->error)
		r->status = blk.ctl.status;
}

/* The entries are checked first: a bad one refuses the whole message. */
static int vgpu_sched_check(const struct vgpu_sched *in, u32 n,
			    const char **why)
{
	u32 i;

	for (i = 0; i < n; i++) {
		if (in[i].enable > VGPU_SCHED_INTERLEAVE) {
			*why = "vgpu: SCHED entry with an unknown op";
			return -EINVAL;
		}
		if (in[i].arg && in[i].enable != VGPU_SCHED_TIMESLICE &&
		    in[i].enable != VGPU_SCHED_INTERLEAVE) {
			*why = "vgpu: SCHED entry with an arg its op does not take";
			return -EINVAL;
		}
	}
	return 0;
}

/* One entry: find its context, hold the backing file for the call. */
static void vgpu_sched_entry(const struct vgpu_sched *s, unsigned long ubuf,
			     struct vgpu_sched_result *r)
{
	struct file *backing;

	if (fatal_signal_pending(current)) {
		r->error = -EINTR;
		return;
	}
	backing = vgpu_rm_backing(s->ctx_id, &r->error);
	if (!backing)
		return;
	vgpu_sched_one(backing, s, ubuf, r);
	fput(backing);
}

static u64 vgpu_sched_key(const struct vgpu_sched *s)
{
	return s->ctx_id ^ ((u64)s->h_client << 32 | s->h_object);
}

static struct vgpu_sched_off *vgpu_sched_off_find(const struct vgpu_sched *s)
{
	struct vgpu_sched_off *o;

	lockdep_assert_held(&vgpu_sched_off_lock);
	hash_for_each_possible(vgpu_sched_offs, o, node, vgpu_sched_key(s))
		if (o->ctx_id == s->ctx_id && o->h_client == s->h_client &&
		    o->h_object == s->h_object)
			return o;
	return NULL;
}

/*
 * Record @s as off before it is applied, so that no group is ever off
 * without a record. Return: 1 recorded here, 0 already recorded, or a
 * negative errno.
 */
static int vgpu_sched_off_add(const struct vgpu_sched *s)
{
	struct vgpu_sched_off *rec;
	int ret = 1;

	rec = kzalloc(sizeof(*rec), GFP_KERNEL);
	if (!rec)
		return -ENOMEM;
	rec->ctx_id = s->ctx_id;
	rec->h_client = s->h_client;
	rec->h_object = s->h_object;
	mutex_lock(&vgpu_sched_off_lock);
	if (vgpu_sched_off_find(s)) {
		ret = 0;
	} else if (vgpu_sched_n_off >= READ_ONCE(vgpu_sched_off_max)) {
		ret = -ENOSPC;
	} else {
		hash_add(vgpu_sched_offs, &rec->node, vgpu_sched_key(s));
		vgpu_sched_n_off++;
		rec = NULL;
	}
	mutex_unlock(&vgpu_sched_off_lock);
	kfree(rec);
	return ret;
}

static void vgpu_sched_off_del(const struct vgpu_sched *s)
{
	struct vgpu_sched_off *o;

	mutex_lock(&vgpu_sched_off_lock);
	o = vgpu_sched_off_find(s);
	if (o) {
		hash_del(&o->node);
		vgpu_sched_n_off--;
	}
	mutex_unlock(&vgpu_sched_off_lock);
	kfree(o);
}

/* Is @r the driver's answer for a group, or a client, that no longer exists? */
static bool vgpu_sched_gone(const struct vgpu_sched_result *r)
{
	return r->error == -ENOENT ||
	       (!r->error && (r->status == NV_ERR_INVALID_OBJECT_HANDLE ||
			      r->status == NV_ERR_INVALID_CLIENT));
}

/*
 * Sweep the table: issue every record's "off" again (idempotent: a
 * recorded group is off) and drop the records of groups or contexts that
 * are gone. Runs in the daemon's process, under vgpu_sched_lock. Return:
 * how many records were dropped.
 */
static u32 vgpu_sched_sweep(unsigned long ubuf)
{
	struct vgpu_sched_result r;
	struct vgpu_sched_off *o;
	struct vgpu_sched *keys;
	u32 n = 0, i, dropped = 0;
	unsigned int bkt;

	lockdep_assert_held(&vgpu_sched_lock);
	mutex_lock(&vgpu_sched_off_lock);
	keys = kvmalloc_array(max(vgpu_sched_n_off, 1U), sizeof(*keys),
			      GFP_KERNEL);
	if (keys) {
		hash_for_each(vgpu_sched_offs, bkt, o, node)
			keys[n++] = (struct vgpu_sched) {
				.ctx_id = o->ctx_id,
				.h_client = o->h_client,
				.h_object = o->h_object,
				.enable = VGPU_SCHED_OFF,
			};
	}
	mutex_unlock(&vgpu_sched_off_lock);
	if (!keys)
		return 0;
	for (i = 0; i < n && !fatal_signal_pending(current); i++) {
		r = (struct vgpu_sched_result) {};
		vgpu_sched_entry(&keys[i], ubuf, &r);
		if (vgpu_sched_gone(&r)) {
			vgpu_sched_off_del(&keys[i]);
			dropped++;
		}
	}
	kvfree(keys);
	return dropped;
}

/*
 * Apply one entry and keep the record of the groups turned off: an "on" or
 * an owner's "off" that succeeds drops the record, an "off" recorded here
 * that fails too; a timeslice or a preemption leaves it as it is. Records
 * are found again by key: a close or a registration may drop them in
 * between. A full table is swept once.
 */
static void vgpu_sched_apply(const struct vgpu_sched *s, unsigned long ubuf,
			     struct vgpu_sched_result *r)
{
	int added = 0;
	bool ok;

	if (s->enable == VGPU_SCHED_OFF) {
		added = vgpu_sched_off_add(s);
		if (added == -ENOSPC && vgpu_sched_sweep(ubuf))
			added = vgpu_sched_off_add(s);
		if (added < 0) {
			r->error = added;
			return;
		}
	}
	vgpu_sched_entry(s, ubuf, r);
	ok = !r->error && !r->status;
	switch (s->enable) {
	case VGPU_SCHED_OFF:
		if (!ok && added)
			vgpu_sched_off_del(s);
		break;
	case VGPU_SCHED_ON:
	case VGPU_SCHED_OWNER_OFF:
		if (ok)
			vgpu_sched_off_del(s);
		break;
	default:
		break;
	}
}

/**
 * vgpu_schedule - apply SCHEDULE entries, in order
 * @in: the entries
 * @n: how many, 1..VGPU_SCHED_MAX
 * @out: their results, same order
 * @why: out: on a refused message, a static reason
 *
 * Runs in the sender's process context. An unknown op, or an arg where
 * its op takes none, refuses the message (-EINVAL, nothing applied). An
 * entry whose context is gone gets -ENOENT, one whose context is not a
 * nvidiactl file -EINVAL; the others get the ioctl's error and the
 * driver's status. After a fatal
 * signal the entries left get -EINTR.
 *
 * Return: 0 when every entry has a result, else a negative errno (and
 * nothing was applied).
 */
int vgpu_schedule(const struct vgpu_sched *in, u32 n,
		  struct vgpu_sched_result *out, const char **why)
{
	unsigned long ubuf;
	u64 t0;
	u32 i;
	int err;

	BUILD_BUG_ON(sizeof(struct nvos54) != 32);
	BUILD_BUG_ON(offsetof(struct nvos54, params) != 16);
	BUILD_BUG_ON(offsetof(struct nvos54, status) != 28);
	BUILD_BUG_ON(sizeof(struct nva06c_gpfifo_schedule_params) != 3);
	BUILD_BUG_ON(sizeof(struct nva06c_timeslice_params) != 8);
	BUILD_BUG_ON(sizeof(struct nva06c_preempt_params) != 8);
	BUILD_BUG_ON(offsetof(struct nva06c_preempt_params, timeout_us) != 4);
	BUILD_BUG_ON(sizeof(struct nva06c_interleave_level_params) != 4);
	BUILD_BUG_ON(sizeof(struct vgpu_sched_block) > PAGE_SIZE);

	err = vgpu_sched_check(in, n, why);
	if (err)
		return err;
	ubuf = vgpu_rm_page_map(why);
	if (IS_ERR_VALUE(ubuf))
		return (int)ubuf;

	mutex_lock(&vgpu_sched_lock);
	for (i = 0; i < n; i++) {
		out[i] = (struct vgpu_sched_result) {};
		t0 = trace_vgpu_schedule_enabled() ? ktime_get_ns() : 0;
		vgpu_sched_apply(&in[i], ubuf, &out[i]);
		if (trace_vgpu_schedule_enabled())
			trace_vgpu_schedule(in[i].ctx_id, in[i].h_client,
					    in[i].h_object, in[i].enable,
					    out[i].error, out[i].status,
					    t0 ? ktime_get_ns() - t0 : 0);
	}
	mutex_unlock(&vgpu_sched_lock);

	vgpu_rm_page_unmap(ubuf);
	return 0;
}

/* Is @nr / @size an RM_ALLOC whose params vgpu_sched_new_group() reads? */
bool vgpu_sched_alloc_layout(u32 nr, u32 size)
{
	return nr == NV_ESC_RM_ALLOC &&
	       (size == sizeof(struct nvos21) || size == sizeof(struct nvos64));
}

/**
 * vgpu_sched_new_group - turn off a channel group the caller has just made
 * @ctx: the caller's context, whose file the RM_ALLOC went through
 * @checked: the head of the RM_ALLOC params (NVOS64 begins as NVOS21) as
 *	the module checked them before the driver call
 * @results: the same head as read back after the call, or NULL
 *
 * Runs in the caller's process before its RM_ALLOC returns (the driver
 * reads the control from the current process's memory), so the group is
 * off before the caller has its handle: it cannot have had work to run.
 *
 * The handle and class are those of the checked copy, never the results
 * read back from the shadow: those lie in the caller's memory, where a
 * sibling thread can rewrite the status or hObjectNew before they are
 * read. So the status is not read either: the "off" is issued for the
 * checked handle whatever the results say, and a group that does not
 * exist gets the driver's error (and leaves no record). A call that asked
 * for anything but a channel group is left alone. A handle generated by
 * the driver (hObjectNew 0) is known only from @results (NULL: none read
 * back): it is taken from there, under the checked client, so that a
 * rewrite can only turn off another group of the caller's own client or
 * none (the residual of docs/threat-model.md, item 7). The group is
 * remembered as off like a SCHEDULE entry; one that could not be turned
 * off (a full table included: sweeping it issues controls for other
 * tenants' groups, which must not run in a tenant's process) shows in the
 * vgpu_schedule tracepoint, and the daemon, which learns of it from the
 * POST that follows, turns it off in its turn.
 */
void vgpu_sched_new_group(struct vgpu_ctx *ctx, const struct nvos21 *checked,
			  const struct nvos21 *results)
{
	struct vgpu_sched s = { .ctx_id = ctx->id };
	struct vgpu_sched_result r = {};
	unsigned long ubuf;
	int added;
	u64 t0;

	BUILD_BUG_ON(offsetof(struct nvos64, h_class) !=
		     offsetof(struct nvos21, h_class));
	BUILD_BUG_ON(offsetof(struct nvos64, h_object_new) !=
		     offsetof(struct nvos21, h_object_new));
	if (checked->h_class != KEPLER_CHANNEL_GROUP_A || !current->mm)
		return;
	s.h_client = checked->h_root;
	s.h_object = checked->h_object_new;
	if (!s.h_object && results)
		s.h_object = results->h_object_new;
	if (!s.h_object)
		return;

	t0 = trace_vgpu_schedule_enabled() ? ktime_get_ns() : 0;
	added = vgpu_sched_off_add(&s);
	if (added < 0) {
		r.error = added;
		goto out;
	}
	ubuf = vm_mmap(NULL, 0, PAGE_SIZE, PROT_READ | PROT_WRITE,
		       MAP_PRIVATE | MAP_ANONYMOUS, 0);
	if (IS_ERR_VALUE(ubuf)) {
		r.error = (int)ubuf;
	} else {
		vgpu_sched_one(ctx->backing, &s, ubuf, &r);
		vm_munmap(ubuf, PAGE_SIZE);
	}
	if ((r.error || r.status) && added)
		vgpu_sched_off_del(&s);
out:
	if (trace_vgpu_schedule_enabled())
		trace_vgpu_schedule(s.ctx_id, s.h_client, s.h_object, 0,
				    r.error, r.status,
				    t0 ? ktime_get_ns() - t0 : 0);
}

/**
 * vgpu_sched_restore - turn on every group a gone daemon left off
 *
 * Called when a daemon registers, in its process context (the driver reads
 * the control from the current process's memory). Records whose group or
 * context is gone are dropped like the others.
 *
 * Return: how many groups were turned back on.
 */
u32 vgpu_sched_restore(void)
{
	struct vgpu_sched_off *o;
	struct hlist_node *tmp;
	struct vgpu_sched_result r;
	struct vgpu_sched s = { .enable = VGPU_SCHED_ON };
	unsigned long ubuf;
	HLIST_HEAD(offs);
	u32 restored = 0;
	unsigned int bkt;

	mutex_lock(&vgpu_sched_lock);
	mutex_lock(&vgpu_sched_off_lock);
	hash_for_each_safe(vgpu_sched_offs, bkt, tmp, o, node) {
		hash_del(&o->node);
		hlist_add_head(&o->node, &offs);
	}
	vgpu_sched_n_off = 0;
	mutex_unlock(&vgpu_sched_off_lock);
	if (hlist_empty(&offs)) {
		mutex_unlock(&vgpu_sched_lock);
		return 0;
	}

	ubuf = current->mm ? vm_mmap(NULL, 0, PAGE_SIZE, PROT_READ | PROT_WRITE,
				     MAP_PRIVATE | MAP_ANONYMOUS, 0) : -ENOMEM;
	hlist_for_each_entry_safe(o, tmp, &offs, node) {
		if (!IS_ERR_VALUE(ubuf)) {
			s.ctx_id = o->ctx_id;
			s.h_client = o->h_client;
			s.h_object = o->h_object;
			r = (struct vgpu_sched_result) {};
			vgpu_sched_entry(&s, ubuf, &r);
			if (!r.error && !r.status)
				restored++;
		}
		hlist_del(&o->node);
		kfree(o);
	}
	mutex_unlock(&vgpu_sched_lock);
	if (IS_ERR_VALUE(ubuf))
		pr_warn("vgpu: could not map a page to turn channel groups back on\n");
	else
		vm_munmap(ubuf, PAGE_SIZE);
	return restored;
}

/* The context is gone: its groups went with its client. */
void vgpu_sched_forget(u64 ctx_id)
{
	struct vgpu_sched_off *o;
	struct hlist_node *tmp;
	unsigned int bkt;

	mutex_lock(&vgpu_sched_off_lock);
	hash_for_each_safe(vgpu_sched_offs, bkt, tmp, o, node) {
		if (o->ctx_id == ctx_id) {
			hash_del(&o->node);
			vgpu_sched_n_off--;
			kfree(o);
		}
	}
	mutex_unlock(&vgpu_sched_off_lock);
}

void vgpu_sched_exit(void)
{
	struct vgpu_sched_off *o;
	struct hlist_node *tmp;
	unsigned int bkt;

	mutex_lock(&vgpu_sched_off_lock);
	hash_for_each_safe(vgpu_sched_offs, bkt, tmp, o, node) {
		hash_del(&o->node);
		kfree(o);
	}
	vgpu_sched_n_off = 0;
	mutex_unlock(&vgpu_sched_off_lock);
}
