// SPDX-License-Identifier: GPL-2.0
/*
 * SCHEDULE: turn channel groups on and off through their owners' files.
 *
 * Each entry becomes one RM_CONTROL NVA06C_CTRL_CMD_GPFIFO_SCHEDULE issued
 * on the backing file of the context that owns the RM client, as if the
 * owner had called it. The driver reads NVOS54 and its params from the
 * current process's user memory, and the generic netlink handler runs in
 * the sender's (the daemon's) process: the blocks live in a small private
 * anonymous mapping of the daemon's mm, made once per message. The daemon's
 * own threads could write into it during the call; the daemon is trusted
 * (CAP_NET_ADMIN and the registered port), and the results it would spoil
 * are its own.
 */
#include <linux/build_bug.h>
#include <linux/file.h>
#include <linux/fs.h>
#include <linux/ioctl.h>
#include <linux/mm.h>
#include <linux/mman.h>
#include <linux/sched.h>
#include <linux/sched/signal.h>
#include <linux/stddef.h>
#include <linux/string.h>
#include <linux/timekeeping.h>
#include <linux/uaccess.h>

#include "vgpu.h"
#include "trace.h"

#define NV_IOCTL_MAGIC			'F'
#define NV_ESC_RM_CONTROL		0x2A
#define NVA06C_CTRL_CMD_GPFIFO_SCHEDULE	0xA06C0101

/**
 * struct nvos54 - params of NV_ESC_RM_CONTROL
 * @h_client: the RM client
 * @h_object: the object the control is exported on
 * @cmd: the control command
 * @flags: zero
 * @params: user pointer to the command's params
 * @params_size: their size
 * @status: out: the NVIDIA status
 */
struct nvos54 {
	u32 h_client;
	u32 h_object;
	u32 cmd;
	u32 flags;
	u64 params;
	u32 params_size;
	u32 status;
};

/**
 * struct nva06c_gpfifo_schedule - params of GPFIFO_SCHEDULE
 * @enable: 1 on, 0 off
 * @skip_submit: zero
 * @skip_enable: zero
 */
struct nva06c_gpfifo_schedule {
	u8 enable;
	u8 skip_submit;
	u8 skip_enable;
};

/* What the daemon's mapping holds during one call. */
struct vgpu_sched_block {
	struct nvos54 ctl;
	struct nva06c_gpfifo_schedule params;
};

#define VGPU_RM_CONTROL	_IOC(_IOC_READ | _IOC_WRITE, NV_IOCTL_MAGIC, \
			     NV_ESC_RM_CONTROL, sizeof(struct nvos54))

/* One GPFIFO_SCHEDULE through @backing; the blocks go to user @ubuf. */
static void vgpu_sched_one(struct file *backing, const struct vgpu_sched *s,
			   unsigned long ubuf, struct vgpu_sched_result *r)
{
	struct vgpu_sched_block __user *u = (void __user *)ubuf;
	struct vgpu_sched_block blk;
	long ret;

	memset(&blk, 0, sizeof(blk));	/* padding included */
	blk.ctl.h_client = s->h_client;
	blk.ctl.h_object = s->h_object;
	blk.ctl.cmd = NVA06C_CTRL_CMD_GPFIFO_SCHEDULE;
	blk.ctl.params = ubuf + offsetof(struct vgpu_sched_block, params);
	blk.ctl.params_size = sizeof(blk.params);
	blk.params.enable = s->enable;
	if (!backing->f_op->unlocked_ioctl) {
		r->error = -ENOTTY;
		return;
	}
	if (copy_to_user(u, &blk, sizeof(blk))) {
		r->error = -EFAULT;
		return;
	}
	ret = backing->f_op->unlocked_ioctl(backing, VGPU_RM_CONTROL,
					    (unsigned long)&u->ctl);
	if (ret < 0) {
		r->error = ret;
		return;
	}
	if (get_user(r->status, &u->ctl.status))
		r->error = -EFAULT;
}

/* The entries are checked first: a bad one refuses the whole message. */
static int vgpu_sched_check(const struct vgpu_sched *in, u32 n,
			    const char **why)
{
	u32 i;

	for (i = 0; i < n; i++) {
		if (in[i].reserved) {
			*why = "vgpu: SCHED entry with nonzero reserved field";
			return -EINVAL;
		}
		if (in[i].enable > 1) {
			*why = "vgpu: SCHED entry with enable other than 0 or 1";
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
	u32 node;

	if (fatal_signal_pending(current)) {
		r->error = -EINTR;
		return;
	}
	backing = vgpu_ctx_backing_get(s->ctx_id, &node);
	if (!backing) {
		r->error = -ENOENT;
		return;
	}
	if (node != VGPU_NODE_CTL)
		r->error = -EINVAL;
	else
		vgpu_sched_one(backing, s, ubuf, r);
	fput(backing);
}

/**
 * vgpu_schedule - apply SCHEDULE entries, in order
 * @in: the entries
 * @n: how many, 1..VGPU_SCHED_MAX
 * @out: their results, same order
 * @why: out: on a refused message, a static reason
 *
 * Runs in the sender's process context. An entry whose context is gone
 * gets -ENOENT, one whose context is not a nvidiactl file -EINVAL; the
 * others get the ioctl's error and the driver's status. After a fatal
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
	BUILD_BUG_ON(sizeof(struct nva06c_gpfifo_schedule) != 3);
	BUILD_BUG_ON(sizeof(struct vgpu_sched_block) > PAGE_SIZE);

	err = vgpu_sched_check(in, n, why);
	if (err)
		return err;
	if (!current->mm) {
		*why = "vgpu: SCHEDULE needs a sender with user memory";
		return -EOPNOTSUPP;
	}
	ubuf = vm_mmap(NULL, 0, PAGE_SIZE, PROT_READ | PROT_WRITE,
		       MAP_PRIVATE | MAP_ANONYMOUS, 0);
	if (IS_ERR_VALUE(ubuf))
		return (int)ubuf;

	for (i = 0; i < n; i++) {
		out[i] = (struct vgpu_sched_result) {};
		t0 = trace_vgpu_schedule_enabled() ? ktime_get_ns() : 0;
		vgpu_sched_entry(&in[i], ubuf, &out[i]);
		if (trace_vgpu_schedule_enabled())
			trace_vgpu_schedule(in[i].ctx_id, in[i].h_client,
					    in[i].h_object, in[i].enable,
					    out[i].error, out[i].status,
					    t0 ? ktime_get_ns() - t0 : 0);
	}

	vm_munmap(ubuf, PAGE_SIZE);
	return 0;
}
