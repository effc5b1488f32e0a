// SPDX-License-Identifier: GPL-2.0
/*
 * fd translation. Some NVIDIA escapes carry fd numbers that the driver
 * resolves in the caller's fd table and checks to be its own files. Behind
 * our emulated files those numbers name our files, so for the duration of
 * the call the backing file is installed under a temporary fd number, which
 * replaces the caller's number in the params; the caller's number is put
 * back afterwards. An fd that is not one of ours is left to the driver.
 */
#include <linux/fcntl.h>
#include <linux/fdtable.h>
#include <linux/file.h>
#include <linux/stddef.h>
#include <linux/uaccess.h>

#include "vgpu.h"

/**
 * struct vgpu_fd_arg - an escape that carries an fd
 * @node: enum vgpu_node it is issued on
 * @nr: escape number
 * @size: exact params size
 * @off: offset of the int fd in the params
 */
struct vgpu_fd_arg {
	u8 node;
	u8 nr;
	u16 size;
	u16 off;
};

#define VGPU_FD_ARG(node, nr, type, field) \
	{ node, nr, sizeof(struct type), offsetof(struct type, field) }

static const struct vgpu_fd_arg vgpu_fd_args[] = {
	VGPU_FD_ARG(VGPU_NODE_GPU, NV_ESC_REGISTER_FD, nv_register_fd, ctl_fd),
	VGPU_FD_ARG(VGPU_NODE_CTL, NV_ESC_RM_MAP_MEMORY, nvos33_with_fd, fd),
	VGPU_FD_ARG(VGPU_NODE_GPU, NV_ESC_RM_ALLOC_MEMORY, nvos02_with_fd, fd),
};

/* Sets in @map the escape numbers of @node that carry an fd. */
void vgpu_fdx_mark(unsigned long *map, u32 node)
{
	size_t i;

	for (i = 0; i < ARRAY_SIZE(vgpu_fd_args); i++)
		if (vgpu_fd_args[i].node == node)
			__set_bit(vgpu_fd_args[i].nr, map);
}

/**
 * vgpu_fdx_prepare - translate the fd argument of a call, if it has one
 * @x: state for vgpu_fdx_finish()
 * @node: enum vgpu_node
 * @nr: escape number
 * @size: params size
 * @params: the caller's params
 *
 * Return: 0 (also when nothing was translated), or a negative errno: the
 * call must then fail without reaching the driver.
 */
int vgpu_fdx_prepare(struct vgpu_fdx *x, u32 node, u32 nr, u32 size,
		     void __user *params)
{
	const struct vgpu_fd_arg *a = NULL;
	struct vgpu_ctx *ctx;
	struct file *f;
	int __user *uptr;
	int fd, tmp;
	size_t i;

	x->ours = NULL;
	for (i = 0; i < ARRAY_SIZE(vgpu_fd_args); i++) {
		if (vgpu_fd_args[i].node == node && vgpu_fd_args[i].nr == nr &&
		    vgpu_fd_args[i].size == size) {
			a = &vgpu_fd_args[i];
			break;
		}
	}
	if (!a)
		return 0;
	uptr = params + a->off;
	if (get_user(fd, uptr))
		return 0;		/* the driver reports the fault */
	f = fget(fd);
	if (!f)
		return 0;
	if (f->f_op != &vgpu_fops) {
		fput(f);
		return 0;
	}
	ctx = f->private_data;
	tmp = get_unused_fd_flags(O_CLOEXEC);
	if (tmp < 0) {
		fput(f);
		return tmp;
	}
	if (put_user(tmp, uptr)) {
		put_unused_fd(tmp);
		fput(f);
		return -EFAULT;
	}
	fd_install(tmp, get_file(ctx->backing));
	x->ours = f;
	x->uptr = uptr;
	x->orig_fd = fd;
	x->tmp_fd = tmp;
	return 0;
}

/* Puts the caller's fd number back and closes the temporary fd. */
void vgpu_fdx_finish(struct vgpu_fdx *x)
{
	if (!x->ours)
		return;
	if (put_user(x->orig_fd, x->uptr))
		pr_debug("vgpu: could not restore fd %d in params\n",
			 x->orig_fd);
	close_fd(x->tmp_fd);
	fput(x->ours);
	x->ours = NULL;
}
