// SPDX-License-Identifier: GPL-2.0
/*
 * The module's own RM calls: an RM control (or free) issued on the backing
 * file of a live context (a nvidiactl one, vgpu_rm_backing()), as its owner
 * could, on blocks of the module's own. The driver reads NVOS54 and its
 * params (NVOS00 for a free) from the current process's user memory, so the
 * blocks go through a private page of the current process: the sender's
 * (the daemon's) for SCHEDULE (sched.c) and OBJECT (object.c), mapped once
 * per message (vgpu_rm_page_map()), and for the restore at its
 * registration; the caller's own for a channel group it has just made
 * (sched.c: vgpu_sched_new_group).
 */
#include <linux/bug.h>
#include <linux/file.h>
#include <linux/fs.h>
#include <linux/mm.h>
#include <linux/mman.h>
#include <linux/sched.h>
#include <linux/uaccess.h>

#include "vgpu.h"

/**
 * vgpu_rm_call - one RM call through a backing file, on blocks of our own
 * @backing: the backing file (held by the caller)
 * @cmd: the ioctl command word
 * @ubuf: a private page of the current process (vgpu_rm_page_map())
 * @blk: the blocks, written at @ubuf: the ioctl's params first, then what
 *	they point to (pointers already name @ubuf's addresses); on success,
 *	the blocks as the driver left them
 * @len: their size, at most PAGE_SIZE
 *
 * The driver reads and writes the current process's memory, so the
 * blocks go to @ubuf for the call and come back from it.
 *
 * Return: 0 (the driver's status is in @blk), or a negative errno.
 */
int vgpu_rm_call(struct file *backing, unsigned int cmd, unsigned long ubuf,
		 void *blk, size_t len)
{
	void __user *u = (void __user *)ubuf;
	long ret;

	if (WARN_ON_ONCE(len > PAGE_SIZE))
		return -EINVAL;
	if (!backing->f_op->unlocked_ioctl)
		return -ENOTTY;
	if (copy_to_user(u, blk, len))
		return -EFAULT;
	ret = backing->f_op->unlocked_ioctl(backing, cmd, ubuf);
	if (ret < 0)
		return ret;
	if (copy_from_user(blk, u, len))
		return -EFAULT;
	return 0;
}

/*
 * A private page of the sender's mm for vgpu_rm_call(), or an errno (and
 * a static message in @why).
 */
unsigned long vgpu_rm_page_map(const char **why)
{
	if (!current->mm) {
		*why = "vgpu: the command needs a sender with user memory";
		return -EOPNOTSUPP;
	}
	return vm_mmap(NULL, 0, PAGE_SIZE, PROT_READ | PROT_WRITE,
		       MAP_PRIVATE | MAP_ANONYMOUS, 0);
}

void vgpu_rm_page_unmap(unsigned long ubuf)
{
	vm_munmap(ubuf, PAGE_SIZE);
}

/**
 * vgpu_rm_backing - hold the backing file of a live nvidiactl context
 * @ctx_id: the context
 * @err: out: -ENOENT (no such context) or -EINVAL (not a nvidiactl file)
 *
 * Return: the file (the caller fputs it), or NULL and *err.
 */
struct file *vgpu_rm_backing(u64 ctx_id, int *err)
{
	struct file *backing;
	u32 node;

	backing = vgpu_ctx_backing_get(ctx_id, &node);
	if (!backing) {
		*err = -ENOENT;
		return NULL;
	}
	if (node != VGPU_NODE_CTL) {
		fput(backing);
		*err = -EINVAL;
		return NULL;
	}
	return backing;
}
