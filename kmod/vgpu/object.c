// SPDX-License-Identifier: GPL-2.0
/*
 * OBJECT: the driver's truth about a tenant's objects, asked for the daemon.
 *
 * A tenant's params, and the shadow the driver wrote its results into, lie
 * in the tenant's own memory: a sibling thread can rewrite a status, a
 * handle or a size there before anyone reads them. So what the daemon
 * charges is not read from there. Each operation of an OBJECT message is
 * one RM call issued on the backing file of the context whose client owns
 * the object, as the owner could, from a private page of the sender's (the
 * daemon's) mm (rmcall.c: vgpu_rm_call); nothing of it is in the tenant's
 * reach:
 *
 *   CLASS, PARENT  NV0000_CTRL_CMD_CLIENT_GET_HANDLE_INFO on the client
 *   MEM_SIZE       NV0041_CTRL_CMD_GET_SURFACE_INFO (PHYS_SIZE) on the object
 *   FREE           NV_ESC_RM_FREE of the object under its parent
 *
 * The daemon's own threads could write the page during a call; the daemon
 * is trusted (CAP_NET_ADMIN and the registered port), and the answers it
 * would spoil are its own.
 */
#include <linux/atomic.h>
#include <linux/build_bug.h>
#include <linux/err.h>
#include <linux/file.h>
#include <linux/mm.h>
#include <linux/sched/signal.h>
#include <linux/stddef.h>
#include <linux/string.h>

#include <nvidia/nv_rm.h>

#include "vgpu.h"

/* Operations run (struct vgpu_stats4 objects); an atomic of its own. */
static atomic64_t vgpu_objects = ATOMIC64_INIT(0);

u64 vgpu_objects_run(void)
{
	return atomic64_read(&vgpu_objects);
}

/* What the daemon's page holds for one control. */
struct vgpu_obj_ctl_block {
	struct nvos54 ctl;
	union {
		struct nv0000_client_get_handle_info_params handle;
		struct {
			struct nv0041_get_surface_info_params params;
			struct nv0041_surface_info entry;
		} surface;
	};
};

/* One control on (@h_client, @h_object); *status the driver's. */
static int vgpu_obj_control(struct file *backing, unsigned long ubuf,
			    struct vgpu_obj_ctl_block *blk, u32 h_client,
			    u32 h_object, u32 cmd, u32 size, u32 *status)
{
	int err;

	blk->ctl.h_client = h_client;
	blk->ctl.h_object = h_object;
	blk->ctl.cmd = cmd;
	blk->ctl.params = ubuf + offsetof(struct vgpu_obj_ctl_block, handle);
	blk->ctl.params_size = size;
	err = vgpu_rm_call(backing, VGPU_RM_CONTROL, ubuf, blk, sizeof(*blk));
	if (!err)
		*status = blk->ctl.status;
	return err;
}

/* One operation through @backing, from the page at @ubuf. */
static void vgpu_obj_one(struct file *backing, const struct vgpu_obj_op *op,
			 unsigned long ubuf, struct vgpu_obj_result *r)
{
	struct vgpu_obj_ctl_block blk;
	struct nvos00 fr;
	u64 value = 0;

	memset(&blk, 0, sizeof(blk));	/* padding included */
	switch (op->op) {
	case VGPU_OBJ_CLASS:
	case VGPU_OBJ_PARENT:
		blk.handle.h_object = op->h_object;
		blk.handle.index = op->op == VGPU_OBJ_CLASS ?
			NV0000_CTRL_CMD_CLIENT_GET_HANDLE_INFO_INDEX_CLASSID :
			NV0000_CTRL_CMD_CLIENT_GET_HANDLE_INFO_INDEX_PARENT;
		r->error = vgpu_obj_control(backing, ubuf, &blk, op->h_client,
					    op->h_client,
					    NV0000_CTRL_CMD_CLIENT_GET_HANDLE_INFO,
					    sizeof(blk.handle), &r->status);
		/* A class is an integer result, a parent a handle one. */
		value = op->op == VGPU_OBJ_CLASS ? blk.handle.data.i_result :
			blk.handle.data.h_result;
		break;
	case VGPU_OBJ_MEM_SIZE:
		blk.surface.params.surface_info_list_size = 1;
		blk.surface.params.surface_info_list = ubuf +
			offsetof(struct vgpu_obj_ctl_block, surface.entry);
		blk.surface.entry.index = NV0041_CTRL_SURFACE_INFO_INDEX_PHYS_SIZE;
		r->error = vgpu_obj_control(backing, ubuf, &blk, op->h_client,
					    op->h_object,
					    NV0041_CTRL_CMD_GET_SURFACE_INFO,
					    sizeof(blk.surface.params),
					    &r->status);
		value = (u64)blk.surface.entry.data *
			NV0041_CTRL_SURFACE_INFO_PHYS_SIZE_SCALE_FACTOR;
		break;
	case VGPU_OBJ_FREE:
		fr = (struct nvos00) {
			.h_root = op->h_client,
			.h_object_parent = op->h_parent,
			.h_object_old = op->h_object,
		};
		r->error = vgpu_rm_call(backing, VGPU_RM_FREE, ubuf, &fr,
					sizeof(fr));
		if (!r->error)
			r->status = fr.status;
		break;
	}
	r->value = r->error || r->status ? 0 : value;
}

/* The operations are checked first: a bad one refuses the whole message. */
static int vgpu_obj_check(const struct vgpu_obj_op *in, u32 n,
			  const char **why)
{
	u32 i;

	for (i = 0; i < n; i++) {
		if (in[i].op < VGPU_OBJ_CLASS || in[i].op > VGPU_OBJ_FREE) {
			*why = "vgpu: OBJ operation of an unknown kind";
			return -EINVAL;
		}
		if (in[i].op != VGPU_OBJ_FREE && in[i].h_parent) {
			*why = "vgpu: OBJ h_parent is for VGPU_OBJ_FREE only";
			return -EINVAL;
		}
	}
	return 0;
}

/**
 * vgpu_object - run OBJECT operations, in order
 * @in: the operations
 * @n: how many, 1..VGPU_OBJ_MAX
 * @out: their results, same order
 * @why: out: on a refused message, a static reason
 *
 * Runs in the sender's process context. An operation whose context is
 * gone gets -ENOENT, one whose context is not a nvidiactl file -EINVAL;
 * the others get the ioctl's error and the driver's status. After a fatal
 * signal the operations left get -EINTR.
 *
 * Return: 0 when every operation has a result, else a negative errno (and
 * nothing was run).
 */
int vgpu_object(const struct vgpu_obj_op *in, u32 n,
		struct vgpu_obj_result *out, const char **why)
{
	struct file *backing;
	unsigned long ubuf;
	u32 i;
	int err;

	BUILD_BUG_ON(sizeof(struct nv0000_client_get_handle_info_params) != 16);
	BUILD_BUG_ON(offsetof(struct nv0000_client_get_handle_info_params,
			      data) != 8);
	BUILD_BUG_ON(sizeof(struct nv0041_get_surface_info_params) != 16);
	BUILD_BUG_ON(sizeof(struct nv0041_surface_info) != 8);
	BUILD_BUG_ON(sizeof(struct vgpu_obj_ctl_block) > PAGE_SIZE);

	err = vgpu_obj_check(in, n, why);
	if (err)
		return err;
	ubuf = vgpu_rm_page_map(why);
	if (IS_ERR_VALUE(ubuf))
		return (int)ubuf;
	for (i = 0; i < n; i++) {
		out[i] = (struct vgpu_obj_result) {};
		if (fatal_signal_pending(current)) {
			out[i].error = -EINTR;
			continue;
		}
		backing = vgpu_rm_backing(in[i].ctx_id, &out[i].error);
		if (!backing)
			continue;
		vgpu_obj_one(backing, &in[i], ubuf, &out[i]);
		fput(backing);
		atomic64_inc(&vgpu_objects);
	}
	vgpu_rm_page_unmap(ubuf);
	return 0;
}
